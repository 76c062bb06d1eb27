// xpm/trainer/options/precision.hpp — the training precision (Lightning's names): 32-true, bf16-mixed,
// 16-mixed; autocast around the forward pass; dynamic loss scaling for 16-mixed.
//
//   Precision precision = parse_precision(text, "--precision");
//   check_precision_supported(precision, device);          // 16-mixed refused on CPU
//   DynamicLossScaler scaler;                                // 16-mixed only
//   torch::Tensor logits;
//   {
//     AutocastGuard autocast(precision, device.type());     // bf16/fp16 matmuls inside
//     logits = model->forward(token_ids, padding_mask);
//   }
//   torch::Tensor loss = token_cross_entropy_sum(logits.to(torch::kFloat32), tag_ids);  // fp32
//   (precision == Precision::k16Mixed ? scaler.scale(loss) : loss).backward();
//   ... reduce gradients over ranks ...
//   if (precision != Precision::k16Mixed || !scaler.unscale_(gradients, dist)) optimizer.step();
//   if (precision == Precision::k16Mixed) scaler.update();
//
// What each setting keeps in which dtype (torch.amp's mixed precision, Micikevicius et al. 2018,
// "Mixed Precision Training"): parameters, gradients and optimizer state stay float32 (master
// weights) in every mode; under bf16-mixed / 16-mixed, autocast runs the ops on its
// lower-precision list (linear, matmul, bmm, conv, ...) in bfloat16 / float16 — their outputs,
// and so most saved activations, take 2 bytes per element instead of 4 — and caches the
// low-precision copy of each weight for the rest of the guarded region (2 bytes per weight
// element). bfloat16 has float32's exponent range, so it needs no loss scaling; float16 does:
// small gradients underflow to zero, so the loss is multiplied by a scale before backward and
// the gradients divided by it before the step, and a step whose gradients overflowed (inf/nan)
// is skipped and the scale lowered (DynamicLossScaler, torch.cuda.amp.GradScaler's rule).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/distributed/distributed.hpp"

namespace xpm {

enum class Precision {
  k32True,    // "32-true": float32 everywhere
  kBf16Mixed, // "bf16-mixed": float32 master weights, bfloat16 autocast (CPU and CUDA)
  k16Mixed,   // "16-mixed": float32 master weights, float16 autocast and loss scaling (CUDA)
};

/// "32-true" | "bf16-mixed" | "16-mixed" -> the setting. Throws std::invalid_argument naming the
/// text and `source` (e.g. "--precision") otherwise.
Precision parse_precision(const std::string& text, const std::string& source);
/// The name parse_precision accepts (recorded in checkpoints and the memory model's identity).
std::string to_string(Precision precision);
/// Throws std::invalid_argument naming the setting when `device` cannot run it: 16-mixed needs
/// CUDA (float16 autocast and loss scaling are GPU features; LibTorch's CPU autocast is
/// bfloat16), and no setting runs on a device type other than CPU or CUDA.
void check_precision_supported(Precision precision, const torch::Device& device);

/// RAII: autocast on for `device_type` with the setting's dtype (bf16-mixed: bfloat16; 16-mixed:
/// float16) for the guard's lifetime, then the previous autocast state back; nothing for
/// 32-true. Guard the forward pass only: the loss is computed on logits.to(float32) after the
/// guard ends, and backward runs outside it (as torch.autocast recommends). Leaving the
/// outermost guard clears autocast's cache of low-precision weight copies. Not thread-safe
/// across threads sharing one forward (autocast state is thread-local, like LibTorch's).
/// Throws std::invalid_argument as check_precision_supported for an unsupported pair.
class AutocastGuard {
 public:
  AutocastGuard(Precision precision, torch::DeviceType device_type);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false;
  torch::DeviceType device_type_ = torch::kCPU;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kFloat;
};

struct DynamicLossScalerOptions {
  double initial_scale = 65536.0;  // 2^16, GradScaler's init_scale
  double growth_factor = 2.0;      // scale *= this after growth_interval finite steps in a row
  double backoff_factor = 0.5;     // scale *= this after a step with inf/nan gradients
  std::int64_t growth_interval = 2000;  // finite steps before the scale grows
  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
};

/// Dynamic loss scaling (torch.cuda.amp.GradScaler's rule, without its CUDA kernels): multiply
/// the loss by scale() before backward; after the gradients are complete (reduced over ranks),
/// unscale_() divides them by the scale and says whether any is inf/nan; the caller skips the
/// optimizer step if so; update() then lowers the scale after an overflow or raises it after
/// growth_interval clean steps. Skipped steps are counted. Works on any device (tested on CPU
/// with injected infinities); the job enables it for 16-mixed only.
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(const DynamicLossScalerOptions& options = {});

  /// loss * scale(), same dtype and device as `loss`.
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides every gradient in place by the scale and returns true when some gradient on some
  /// rank holds an inf or nan (then the step must be skipped on every rank). `gradients` are this
  /// rank's: the whole gradient, or its shard of a sharded optimizer; undefined ones are
  /// skipped. Collective when `context` is distributed (one all-reduce, max): every rank calls it
  /// once per step. Records the answer for update(). Throws std::logic_error when called twice
  /// without update() in between; DistributedError from the all-reduce.
  bool unscale_(const std::vector<torch::Tensor>& gradients, DistributedContext& context);
  /// Ends the step: after an overflow, scale *= backoff_factor, skipped_steps += 1 and the
  /// growth count restarts; otherwise, after growth_interval clean steps in a row, scale *=
  /// growth_factor. Throws std::logic_error when unscale_() was not called since the last update.
  void update();

  double current_scale() const { return scale_; }
  std::int64_t skipped_steps() const { return skipped_steps_; }
  std::int64_t clean_steps_in_a_row() const { return growth_tracker_; }
  /// For checkpoints: scale, growth count and skipped steps, and back.
  std::vector<double> state() const;
  /// Throws std::invalid_argument when `state` has not 3 entries or the scale is not > 0.
  void load_state(const std::vector<double>& state);

 private:
  DynamicLossScalerOptions options_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  std::int64_t skipped_steps_ = 0;
  int pending_ = -1;  // -1: no unscale_ since update(); 0/1: found inf
};

}  // namespace xpm
