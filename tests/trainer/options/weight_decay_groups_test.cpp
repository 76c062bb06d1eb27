#include "torch_doctest.hpp"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "xpm/tasks/bilstm_tagger.hpp"
#include "xpm/tasks/transformer_tagger.hpp"
#include "xpm/trainer/options/weight_decay_groups.hpp"

namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

xpm::TransformerTaggerOptions small_transformer() {
  xpm::TransformerTaggerOptions options;
  options.vocab_size = 30;
  options.num_tags = 5;
  options.d_model = 8;
  options.nhead = 2;
  options.dim_feedforward = 16;
  options.num_layers = 2;
  return options;
}

}  // namespace

TEST_CASE("biases and normalization parameters get no weight decay, by name") {
  CHECK(xpm::excluded_from_weight_decay("classifier.bias"));
  CHECK(xpm::excluded_from_weight_decay("encoder.layers.0.self_attn.in_proj_bias"));
  CHECK(xpm::excluded_from_weight_decay("encoder.layers.1.norm2.weight"));
  CHECK(xpm::excluded_from_weight_decay("lstm.bias_hh_l0_reverse"));
  CHECK(xpm::excluded_from_weight_decay("final_layer_norm.weight"));
  CHECK_FALSE(xpm::excluded_from_weight_decay("encoder.layers.0.linear1.weight"));
  CHECK_FALSE(xpm::excluded_from_weight_decay("token_embedding.weight"));
  CHECK_FALSE(xpm::excluded_from_weight_decay("lstm.weight_ih_l0"));
  CHECK_FALSE(xpm::excluded_from_weight_decay("unbiased.weight"));  // "bias" inside a module name
  CHECK_FALSE(xpm::excluded_from_weight_decay("layer.biased_weight"));
}

TEST_CASE("the Transformer tagger's parameters split into decayed matrices and undecayed rest") {
  torch::manual_seed(1);
  xpm::TransformerTagger model(small_transformer());
  const xpm::WeightDecaySplit split = xpm::split_for_weight_decay(*model);
  CHECK(split.decay_names.size() + split.no_decay_names.size() == model->parameters().size());
  for (const char* name : {"token_embedding.weight", "position_embedding.weight",
                                  "encoder.layers.0.self_attn.in_proj_weight",
                                  "encoder.layers.1.self_attn.out_proj.weight",
                                  "encoder.layers.0.linear1.weight", "classifier.weight"}) {
    INFO(name);
    CHECK(contains(split.decay_names, std::string(name)));
  }
  for (const char* name : {"encoder.layers.0.self_attn.in_proj_bias",
                                  "encoder.layers.0.self_attn.out_proj.bias", "encoder.layers.1.norm1.weight",
                                  "encoder.layers.1.norm2.bias", "classifier.bias"}) {
    INFO(name);
    CHECK(contains(split.no_decay_names, std::string(name)));
  }
  // Per layer: 4 matrices decayed; 4 biases + 2 x 2 norm parameters not.
  CHECK(split.decay_names.size() == 2 + 2 * 4 + 1);
  CHECK(split.no_decay_names.size() == 2 * 8 + 1);
}

TEST_CASE("an AdamW step with zero gradients shrinks exactly the decayed parameters by lr x decay") {
  torch::manual_seed(2);
  xpm::TransformerTagger model(small_transformer());
  const auto groups = xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(0.1).weight_decay(0.5));
  REQUIRE(groups.size() == 2);
  torch::optim::AdamW optimizer(groups, torch::optim::AdamWOptions(0.1));
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : model->named_parameters()) {
    before[item.key()] = item.value().detach().clone();
    item.value().mutable_grad() = torch::zeros_like(item.value());
  }
  optimizer.step();
  // AdamW (Loshchilov & Hutter 2019): p <- p * (1 - lr * weight_decay), then the Adam update,
  // which is 0 / (0 + eps) = 0 for a zero gradient.
  const float factor = static_cast<float>(1.0 - 0.1 * 0.5);
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    const torch::Tensor expected =
        xpm::excluded_from_weight_decay(item.key()) ? before[item.key()] : before[item.key()] * factor;
    CHECK(torch::equal(item.value().detach(), expected));
  }
}

TEST_CASE("the BiLSTM's gate biases are excluded and frozen parameters join no group") {
  xpm::BiLstmTaggerOptions options;
  options.vocab_size = 20;
  options.num_tags = 3;
  options.embedding_dim = 4;
  options.hidden_size = 3;
  xpm::BiLstmTagger model(options);
  model->named_parameters()["classifier.weight"].requires_grad_(false);
  const xpm::WeightDecaySplit split = xpm::split_for_weight_decay(*model);
  CHECK(contains(split.no_decay_names, "lstm.bias_ih_l0"));
  CHECK(contains(split.no_decay_names, "lstm.bias_hh_l0_reverse"));
  CHECK(contains(split.decay_names, "lstm.weight_hh_l0"));
  CHECK_FALSE(contains(split.decay_names, "classifier.weight"));
  std::size_t grouped = 0;
  for (const auto& group : xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(1e-3))) {
    grouped += group.params().size();
  }
  CHECK(grouped == model->parameters().size() - 1);
}
