#include "xpm/trainer/options/activation_checkpoint.hpp"

#include <mutex>
#include <utility>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

namespace xpm {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The function, carried through AutogradContext::saved_data (which holds IValues only).
struct FunctionHolder : torch::CustomClassHolder {
  explicit FunctionHolder(CheckpointedFunction f) : function(std::move(f)) {}
  CheckpointedFunction function;
};

struct AutocastState {
  bool cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  at::ScalarType cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  bool gpu_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  at::ScalarType gpu_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, gpu_enabled);
    at::autocast::set_autocast_dtype(at::kCUDA, gpu_dtype);
  }
};

torch::Tensor generator_state(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(at::Generator generator, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input, at::TensorList parameters,
                               const c10::intrusive_ptr<FunctionHolder>& holder) {
    at::Generator generator = at::globalContext().defaultGenerator(input.device());
    ctx->saved_data["rng_state"] = generator_state(generator);
    const AutocastState autocast;
    ctx->saved_data["autocast"] = std::vector<int64_t>{
        autocast.cpu_enabled, static_cast<int64_t>(autocast.cpu_dtype), autocast.gpu_enabled,
        static_cast<int64_t>(autocast.gpu_dtype)};
    ctx->saved_data["function"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["input_requires_grad"] = input.requires_grad();
    std::vector<torch::Tensor> to_save = {input};
    to_save.insert(to_save.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(to_save);
    torch::NoGradGuard no_grad;
    return holder->function(input);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const bool input_requires_grad = ctx->saved_data["input_requires_grad"].toBool();
    auto holder = c10::static_intrusive_pointer_cast<FunctionHolder>(ctx->saved_data["function"].toCapsule());
    torch::Tensor input = saved[0].detach();
    input.requires_grad_(input_requires_grad);

    // Recompute with forward's RNG and autocast state, then put both back as they were.
    at::Generator generator = at::globalContext().defaultGenerator(input.device());
    const torch::Tensor current_rng = generator_state(generator);
    const AutocastState current_autocast;
    const std::vector<int64_t> autocast = ctx->saved_data["autocast"].toIntVector();
    AutocastState forward_autocast;
    forward_autocast.cpu_enabled = autocast[0] != 0;
    forward_autocast.cpu_dtype = static_cast<at::ScalarType>(autocast[1]);
    forward_autocast.gpu_enabled = autocast[2] != 0;
    forward_autocast.gpu_dtype = static_cast<at::ScalarType>(autocast[3]);
    torch::Tensor output;
    set_generator_state(generator, ctx->saved_data["rng_state"].toTensor());
    forward_autocast.apply();
    try {
      torch::AutoGradMode enable_grad(true);
      output = holder->function(input);
    } catch (...) {
      set_generator_state(generator, current_rng);
      current_autocast.apply();
      throw;
    }
    set_generator_state(generator, current_rng);
    current_autocast.apply();

    // Differentiate the recomputed block with respect to the input and every parameter that
    // requires grad; the rest get no gradient.
    std::vector<torch::Tensor> inputs;
    std::vector<std::size_t> positions;  // index in the returned list
    if (input_requires_grad) {
      inputs.push_back(input);
      positions.push_back(0);
    }
    for (std::size_t i = 1; i < saved.size(); ++i) {
      if (saved[i].requires_grad()) {
        inputs.push_back(saved[i]);
        positions.push_back(i);
      }
    }
    variable_list result(saved.size() + 1);  // input, parameters, then the holder (no gradient)
    if (inputs.empty() || !output.requires_grad()) return result;
    const variable_list grads = torch::autograd::grad({output}, inputs, {grad_outputs[0]},
                                                      /*retain_graph=*/false, /*create_graph=*/false,
                                                      /*allow_unused=*/true);
    for (std::size_t k = 0; k < grads.size(); ++k) result[positions[k]] = grads[k];
    return result;
  }
};

}  // namespace

torch::Tensor checkpoint(CheckpointedFunction function, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& parameters) {
  if (!torch::GradMode::is_enabled()) return function(input);
  return CheckpointFunction::apply(input, at::TensorList(parameters),
                                   c10::make_intrusive<FunctionHolder>(std::move(function)));
}

}  // namespace xpm
