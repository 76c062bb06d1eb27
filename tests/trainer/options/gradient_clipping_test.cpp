// Clipping by the global norm: whole gradients against LibTorch's clip_grad_norm_, and at world 2
// (two xpm-sharding-worker processes over gloo) each rank's shards against the unsharded clip.
#include "torch_doctest.hpp"
#include "scratch_folders.hpp"

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "trainer/distributed/sharding_fixture.hpp"
#include "xpm/trainer/options/gradient_clipping.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"

namespace {

namespace fx = sharding_fixture;

// The model's gradient for step 0's whole global batch (both ranks' shares, rank 0's first).
xpm::TransformerTagger model_with_global_gradient(const fx::Corpus& corpus) {
  xpm::TransformerTagger model = fx::make_model(corpus);
  for (int rank = 0; rank < fx::kWorld; ++rank) fx::backward_rank_share(model, corpus, 0, rank);
  return model;
}

torch::Tensor flat_gradient(xpm::TransformerTagger& model) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().reshape({-1}));
  return torch::cat(grads);
}

std::string exact(double value) {
  std::ostringstream out;
  out << std::setprecision(17) << value;
  return out.str();
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

}  // namespace

TEST_CASE("clipping shards of a gradient held whole equals LibTorch's clip_grad_norm_") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger reference = model_with_global_gradient(corpus);
  const torch::Tensor unclipped = flat_gradient(reference);
  const double expected_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.1);
  REQUIRE(expected_norm > 0.2);  // so it clips
  const torch::Tensor expected = flat_gradient(reference);

  // Three uneven pieces of the flat gradient, one process: the norm must not be computed twice.
  torch::Tensor flat = unclipped.clone();
  const std::int64_t n = flat.numel();
  std::vector<torch::Tensor> shards = {flat.narrow(0, 0, 7), flat.narrow(0, 7, n / 2 - 7),
                                       flat.narrow(0, n / 2, n - n / 2)};
  xpm::DistributedContext single_process;
  const double norm = xpm::clip_gradient_norm_(shards, 0.1, single_process);
  CHECK(norm == doctest::Approx(expected_norm).epsilon(1e-6));
  CHECK(max_abs(flat - expected) <= 1e-6 * max_abs(expected));
  // The result has the requested norm: 0.1 / (norm + 1e-6) x norm.
  CHECK(flat.norm().item<double>() == doctest::Approx(0.1).epsilon(1e-5));
}

TEST_CASE("at world 2, clipping each rank's shard by the global norm equals clipping the whole gradient") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger reference = model_with_global_gradient(corpus);
  const torch::Tensor unclipped = flat_gradient(reference);
  const double whole_norm = unclipped.norm().item<double>();
  const double max_norm = whole_norm / 4;
  torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm);
  const torch::Tensor expected = flat_gradient(reference);

  const std::string out = std::string(XPM_BINARY_DIR) + "/tests/sharding/clip_" + std::to_string(::getpid());
  std::filesystem::create_directories(out);
  xpm_test::remove_when_passed(out);
  for (const double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    const double limit = norm_type == 2.0 ? max_norm : max_abs(unclipped) / 4;
    const std::vector<int> codes =
        fx::run_world(XPM_SHARDING_WORKER, {"clip", out, exact(limit), exact(norm_type)}, 2, out + "/clip_log");
    INFO(fx::read_text(out + "/clip_log0.log") << fx::read_text(out + "/clip_log1.log"));
    REQUIRE(codes == std::vector<int>{0, 0});
    std::vector<torch::Tensor> pieces;
    for (int rank = 0; rank < 2; ++rank) {
      const std::vector<torch::Tensor> saved = fx::load_tensors(out + "/clip_rank" + std::to_string(rank) + ".pt");
      REQUIRE(saved.size() == 3);
      const double expected_norm = norm_type == 2.0 ? whole_norm : max_abs(unclipped);
      CHECK(saved[0].item<double>() == doctest::Approx(expected_norm).epsilon(1e-6));  // the global norm
      pieces.push_back(saved[1]);
      pieces.push_back(saved[2]);
    }
    const torch::Tensor assembled = torch::cat(pieces);
    REQUIRE(assembled.numel() == unclipped.numel());
    if (norm_type == 2.0) {
      CHECK(max_abs(assembled - expected) <= 1e-6 * max_abs(expected));
      // A local clip on each shard would have left rank-local norms; the global one scales all by 1/4.
      CHECK(assembled.norm().item<double>() == doctest::Approx(max_norm).epsilon(1e-5));
    } else {
      const double coefficient = limit / (max_abs(unclipped) + 1e-6);
      CHECK(max_abs(assembled - unclipped * coefficient) <= 1e-6 * max_abs(unclipped));
    }
  }
}

TEST_CASE("clipping refuses a bad limit or norm and leaves non-finite gradients alone") {
  xpm::DistributedContext single_process;
  torch::Tensor g = torch::tensor({3.0f, 4.0f});
  CHECK_THROWS_WITH_AS(xpm::clip_gradient_norm_({g}, 0.0, single_process),
                       doctest::Contains("max_norm must be finite and > 0, got 0"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::clip_gradient_norm_({g}, 1.0, single_process, 1.0),
                       doctest::Contains("norm_type must be 2 or infinity, got 1"), std::invalid_argument);
  CHECK(xpm::clip_gradient_norm_({g}, 10.0, single_process) == doctest::Approx(5.0));  // under the limit
  CHECK(torch::equal(g, torch::tensor({3.0f, 4.0f})));
  CHECK(xpm::clip_gradient_norm_({g, torch::Tensor()}, 1.0, single_process) == doctest::Approx(5.0));
  CHECK(g[0].item<float>() == doctest::Approx(3.0 / 5.0).epsilon(1e-5));  // 1 / (5 + 1e-6) x 3
  torch::Tensor bad = torch::tensor({1.0f, std::numeric_limits<float>::infinity()});
  CHECK(std::isinf(xpm::clip_gradient_norm_({bad}, 1.0, single_process)));
  CHECK(bad[0].item<float>() == 1.0f);
}
