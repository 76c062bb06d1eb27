// xpm/trainer/tagging_task.hpp — the bundled task's pieces shared by training (tagging_job),
// probing without training (tagging_probe) and the benchmarks: corpus data, model, AdamW with
// its state allocated, and the probe steps.
//
//   TaggingData data = load_tagging_data(config);         // corpus, split, vocabulary, tags
//   TaggingModelSetup setup(config, data);                 // model + AdamW, state allocated
//   TorchProbeExecutor executor(setup.probe_steps(), CpuMemoryMeter::instance());
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/trainer/brown_corpus.hpp"
#include "xpm/trainer/tagging_job.hpp"
#include "xpm/trainer/transformer_tagger.hpp"

namespace xpm {

struct TaggingData {
  std::size_t file_count = 0;
  std::vector<TaggedSentence> train_sentences;
  std::vector<TaggedSentence> validation_sentences;
  Vocabulary vocab;
  TagSet tags;
  std::vector<EncodedSentence> train;       // encoded train_sentences
  std::vector<EncodedSentence> validation;  // encoded validation_sentences
  std::size_t max_length = 0;               // longest sentence over both splits (tokens)
};

/// Reads the corpus in config.data_dir, splits it and encodes it (see brown_corpus.hpp).
/// Throws std::runtime_error naming the path for missing or malformed data.
TaggingData load_tagging_data(const TaggingJobConfig& config);

/// The model options the config asks for, completed from the data (vocabulary size, tags,
/// max_length at least the longest sentence).
TransformerTaggerOptions model_options_for(const TaggingJobConfig& config, const TaggingData& data);

/// Model and AdamW with the gradients and optimizer state allocated, as in steady-state
/// training. Construct after installing the CpuMemoryMeter so the static memory is counted.
class TaggingModelSetup {
 public:
  TaggingModelSetup(const TaggingJobConfig& config, const TaggingData& data);

  TransformerTagger& model() { return model_; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  const TransformerTaggerOptions& model_options() const { return options_; }

  /// Sets every param group's learning rate.
  void set_learning_rate(double lr);
  /// Back to a fresh AdamW (step 0, zero moments) without freeing the state, so memory stays
  /// at its steady state.
  void reset_optimizer_state();
  /// Probe steps on synthetic batches of dims {bs, l}; the learning rate must be 0 while probing
  /// if the model is trained afterwards.
  TorchProbeSteps probe_steps();
  /// Parameter names, shapes and dtypes, in registration order: the model's signature.
  nlohmann::json signature() const;

 private:
  TransformerTaggerOptions options_;
  TransformerTagger model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

}  // namespace xpm
