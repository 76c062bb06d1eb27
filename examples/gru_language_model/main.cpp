// A character-level GRU language model on the Brown corpus, trained under a CPU memory cap in
// a hand-written LibTorch loop. xpm probes the step once (probe_and_fit), then splits every
// outer batch of sentences into microbatches predicted to fit; the loop accumulates their
// gradients exactly and checks each microbatch's measured peak against its prediction.
//
//   gru-language-model --data-dir data/brown [--steps 60] [--memory-cap-bytes 16000000] [--threads 2]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "brown_sentences.hpp"
#include "xpm/planner/record_dims_view.hpp"
#include "xpm/planner_torch/device_meter.hpp"
#include "xpm/planner_torch/step_probing.hpp"

namespace {

// ---- The model: characters -> embedding 32 -> GRU 128 -> next-character logits.
constexpr std::int64_t kVocab = 128;  // bytes below 128; others map to 0, which is also padding

struct CharGru : torch::nn::Module {
  torch::nn::Embedding embedding{register_module("embedding", torch::nn::Embedding(kVocab, 32))};
  torch::nn::GRU gru{register_module("gru", torch::nn::GRU(torch::nn::GRUOptions(32, 128).batch_first(true)))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(128, kVocab))};
  // Summed next-character loss of [bs, l] character ids; padding (0) is not a target.
  torch::Tensor loss_sum(const torch::Tensor& chars) {
    const std::int64_t l = chars.size(1);
    torch::Tensor hidden = std::get<0>(gru->forward(embedding(chars.narrow(1, 0, l - 1))));
    return torch::nn::functional::cross_entropy(
        head(hidden).reshape({-1, kVocab}), chars.narrow(1, 1, l - 1).reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(0));
  }
};

torch::Tensor encode(const std::vector<const std::string*>& sentences, std::int64_t l) {  // [n, l] ids
  torch::Tensor chars = torch::zeros({static_cast<std::int64_t>(sentences.size()), l}, torch::kLong);
  auto a = chars.accessor<std::int64_t, 2>();
  for (std::size_t i = 0; i < sentences.size(); ++i) {
    for (std::size_t j = 0; j < sentences[i]->size(); ++j) {
      const auto c = static_cast<unsigned char>((*sentences[i])[j]);
      a[static_cast<std::int64_t>(i)][static_cast<std::int64_t>(j)] = c < kVocab ? c : 0;
    }
  }
  return chars;
}

std::string option(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; i += 2) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

std::int64_t positive_option(int argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string text = option(argc, argv, name, fallback);
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || value < 1) {
    throw std::invalid_argument("--" + name + " must be a whole number >= 1, got '" + text + "'");
  }
  return value;
}

}  // namespace

int main(int argc, char** argv) try {
  for (int i = 1; i < argc; i += 2) {
    const std::string name = argv[i];
    if ((name != "--data-dir" && name != "--steps" && name != "--memory-cap-bytes" && name != "--threads") ||
        i + 1 >= argc) {
      std::cerr << "gru-language-model: error: unexpected argument '" << name
                << "' (--data-dir DIR, --steps N, --memory-cap-bytes N, --threads N)\n";
      return 2;
    }
  }
  const brown::Corpus corpus = brown::read_sentences(option(argc, argv, "data-dir", "data/brown"), 256);  // 4 % are longer
  const std::int64_t steps = positive_option(argc, argv, "steps", "60");
  const std::int64_t cap_bytes = positive_option(argc, argv, "memory-cap-bytes", "16000000");
  constexpr std::size_t kOuterBatch = 64;
  std::size_t max_length = 0;
  for (const auto& s : corpus.train) max_length = std::max(max_length, s.text.size());

  // 1. Meter first (it must see the weights), then the model, the optimizer and the cap.
  torch::set_num_threads(static_cast<int>(positive_option(argc, argv, "threads", "2")));
  torch::manual_seed(1);
  const std::shared_ptr<xpm::MemoryMeter> meter = xpm::make_device_meter(torch::kCPU, cap_bytes);
  auto model = std::make_shared<CharGru>();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));

  // 2. Probe the step on random characters and fit the memory model. Two regimes (measured):
  //    small microbatches peak in backward, larger ones with a steeper cost per character.
  xpm::StepProbeOptions probe;
  probe.batcher.formula = xpm::CostFormula::with_variables("max(a*bs*l + b*bs + c, d*bs*l + e)", {"bs", "l"});
  probe.batcher.variable_max = {{"bs", double(kOuterBatch)}, {"l", double(max_length)}};
  probe.batcher.design_fractions = {1.0, 0.5, 0.25};  // most sentences are short: probe short l too
  probe.meter = meter.get();
  probe.log = [](const std::string& line) { std::cout << line << "\n"; };
  const xpm::StepProbeResult probed = xpm::probe_and_fit(*model, optimizer, [&](const std::vector<double>& dims) {
    return model->loss_sum(torch::randint(1, kVocab, {std::int64_t(dims[0]), std::int64_t(dims[1])}));
  }, probe);
  const xpm::PredictiveBatcher& batcher = *probed.batcher;  // the model set
  std::cout << "model: " << probed.model.formula().canonical() << ", floor " << probed.model.floor_bytes()
            << " bytes, usable " << probed.batcher_options.budget.usable_bytes() << " of " << cap_bytes << " bytes\n";

  // 3. Train: each outer batch of 64 sentences is split into microbatches; each microbatch's
  //    loss is divided by the outer batch's characters, so the gradient is the whole batch's.
  std::int64_t ooms = 0, microbatches = 0, characters = 0;
  double worst_under = 0, max_abs_error = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t step = 0; step < steps; ++step) {
    std::vector<const std::string*> outer;
    std::vector<double> lengths;
    double targets = 0;
    for (std::size_t i = 0; i < kOuterBatch; ++i) {
      outer.push_back(&corpus.train[(std::size_t(step) * kOuterBatch + i) % corpus.train.size()].text);
      lengths.push_back(double(outer.back()->size()));
      targets += double(outer.back()->size() - 1);
    }
    const auto dims = xpm::record_dims_from_lengths(lengths, {"bs", "l"});  // {1, length} per sentence
    optimizer.zero_grad(/*set_to_none=*/false);  // keep the gradients the probes measured
    for (const xpm::Microbatch& mb : batcher.plan(dims).microbatches) {
      std::vector<const std::string*> sentences;
      for (std::size_t index : mb.record_indices) sentences.push_back(outer[index]);
      meter->reset_peak();
      try {
        (model->loss_sum(encode(sentences, std::int64_t(mb.dims[1]))) / targets).backward();
      } catch (const c10::OutOfMemoryError&) {
        ++ooms;
        continue;
      }
      const double measured = double(meter->peak_allocated_bytes());
      if (measured > probed.model.floor_bytes()) {  // where the formula, not the floor, binds
        const double error = (mb.predicted_bytes - measured) / measured;
        worst_under = std::min(worst_under, error);
        max_abs_error = std::max(max_abs_error, std::abs(error));
      }
      ++microbatches;
      for (const std::string* sentence : sentences) characters += std::int64_t(sentence->size());
    }
    optimizer.step();
  }
  const double train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // 4. Held-out loss per character (the first 256 held-out sentences, 16 at a time).
  torch::NoGradGuard no_grad;
  double loss = 0, count = 0;
  for (std::size_t i = 0; i + 16 <= std::min<std::size_t>(256, corpus.held_out.size()); i += 16) {
    std::vector<const std::string*> sentences;
    std::size_t l = 0;
    for (std::size_t j = i; j < i + 16; ++j) {
      sentences.push_back(&corpus.held_out[j].text);
      l = std::max(l, corpus.held_out[j].text.size());
      count += double(corpus.held_out[j].text.size() - 1);
    }
    loss += model->loss_sum(encode(sentences, std::int64_t(l))).item<double>();
  }
  std::printf("steps %lld, microbatches %lld, OOM %lld, max |prediction error| %.2f %% (worst under %.2f %%), "
              "%.0f characters/s, held-out loss %.3f nats/char\n",
              static_cast<long long>(steps), static_cast<long long>(microbatches), static_cast<long long>(ooms), 100 * max_abs_error,
              100 * worst_under, double(characters) / train_s, loss / count);
  return ooms == 0 ? 0 : 1;
} catch (const std::invalid_argument& error) {
  std::cerr << "gru-language-model: error: " << error.what() << "\n";
  return 2;
} catch (const std::exception& error) {
  std::cerr << "gru-language-model: error: " << error.what() << "\n";
  return 3;
}
