#include "xpm/trainer/options/precision.hpp"

#include <cmath>
#include <stdexcept>

#include <ATen/autocast_mode.h>
#include "xpm/planner/enum_names.hpp"

namespace xpm {

namespace {
constexpr EnumNames<Precision, 3> kPrecisionNames{
    {{Precision::k32True, "32-true"}, {Precision::kBf16Mixed, "bf16-mixed"}, {Precision::k16Mixed, "16-mixed"}}};
}  // namespace

Precision parse_precision(const std::string& text, const std::string& source) {
  return parse_enum(kPrecisionNames, text, source);
}

std::string to_string(Precision precision) { return enum_name(kPrecisionNames, precision); }

void check_precision_supported(Precision precision, const torch::Device& device) {
  if (!device.is_cpu() && !device.is_cuda()) {
    throw std::invalid_argument("precision '" + to_string(precision) + "' on device '" + device.str() +
                                "': only cpu and cuda devices are supported");
  }
  if (precision == Precision::k16Mixed && !device.is_cuda()) {
    throw std::invalid_argument("precision '16-mixed' needs a CUDA device (float16 autocast and loss scaling "
                                "run on GPUs; LibTorch's CPU autocast is bfloat16), but this run is on '" +
                                device.str() + "': use 'bf16-mixed' or '32-true'");
  }
}

AutocastGuard::AutocastGuard(Precision precision, torch::DeviceType device_type) : device_type_(device_type) {
  check_precision_supported(precision, torch::Device(device_type));
  if (precision == Precision::k32True) return;
  const at::ScalarType dtype = precision == Precision::kBf16Mixed ? at::kBFloat16 : at::kHalf;
  previous_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, dtype);
  at::autocast::increment_nesting();
  active_ = true;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // As torch.autocast's __exit__: the outermost region drops the cached weight casts.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_type_, previous_dtype_);
}

void DynamicLossScalerOptions::validate() const {
  if (!(initial_scale > 0) || !std::isfinite(initial_scale)) {
    throw std::invalid_argument("DynamicLossScalerOptions.initial_scale must be finite and > 0, got " +
                                std::to_string(initial_scale));
  }
  if (!(growth_factor > 1) || !std::isfinite(growth_factor)) {
    throw std::invalid_argument("DynamicLossScalerOptions.growth_factor must be finite and > 1, got " +
                                std::to_string(growth_factor));
  }
  if (!(backoff_factor > 0 && backoff_factor < 1)) {
    throw std::invalid_argument("DynamicLossScalerOptions.backoff_factor must be in (0, 1), got " +
                                std::to_string(backoff_factor));
  }
  if (growth_interval < 1) {
    throw std::invalid_argument("DynamicLossScalerOptions.growth_interval must be >= 1, got " +
                                std::to_string(growth_interval));
  }
}

DynamicLossScaler::DynamicLossScaler(const DynamicLossScalerOptions& options)
    : options_(options), scale_(options.initial_scale) {
  options_.validate();
}

torch::Tensor DynamicLossScaler::scale(const torch::Tensor& loss) const { return loss * scale_; }

bool DynamicLossScaler::unscale_(const std::vector<torch::Tensor>& gradients, DistributedContext& context) {
  if (pending_ >= 0) throw std::logic_error("DynamicLossScaler::unscale_ called twice without update()");
  torch::NoGradGuard no_grad;
  const double inverse_scale = 1.0 / scale_;
  bool found_inf = false;
  for (const torch::Tensor& gradient : gradients) {
    if (!gradient.defined() || gradient.numel() == 0) continue;
    gradient.mul_(inverse_scale);
    // A non-finite element makes the sum inf or nan; reducing to one number allocates nothing
    // of the gradient's size (unlike isfinite(), a bool per element).
    found_inf = found_inf || !std::isfinite(gradient.sum().item<double>());
  }
  found_inf = context.all_reduce({found_inf ? 1.0 : 0.0}, ReduceOp::kMax)[0] > 0;
  pending_ = found_inf ? 1 : 0;
  return found_inf;
}

void DynamicLossScaler::update() {
  if (pending_ < 0) throw std::logic_error("DynamicLossScaler::update called without unscale_()");
  if (pending_ == 1) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    ++skipped_steps_;
  } else if (++growth_tracker_ == options_.growth_interval) {
    scale_ *= options_.growth_factor;
    growth_tracker_ = 0;
  }
  pending_ = -1;
}

std::vector<double> DynamicLossScaler::state() const {
  return {scale_, static_cast<double>(growth_tracker_), static_cast<double>(skipped_steps_)};
}

void DynamicLossScaler::load_state(const std::vector<double>& state) {
  if (state.size() != 3 || !(state[0] > 0) || !std::isfinite(state[0])) {
    throw std::invalid_argument("DynamicLossScaler::load_state: expected {scale > 0, growth count, skipped steps}, got " +
                                std::to_string(state.size()) + " values");
  }
  scale_ = state[0];
  growth_tracker_ = static_cast<std::int64_t>(state[1]);
  skipped_steps_ = static_cast<std::int64_t>(state[2]);
  pending_ = -1;
}

}  // namespace xpm
