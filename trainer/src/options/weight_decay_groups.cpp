#include "xpm/trainer/options/weight_decay_groups.hpp"

#include <memory>
#include <utility>

namespace xpm {

bool excluded_from_weight_decay(const std::string& name) {
  const std::size_t dot = name.rfind('.');
  const std::string last = dot == std::string::npos ? name : name.substr(dot + 1);
  if (last == "bias" || last.rfind("bias_", 0) == 0) return true;  // bias, bias_ih_l0
  if (last.size() > 5 && last.compare(last.size() - 5, 5, "_bias") == 0) return true;  // in_proj_bias
  std::size_t begin = 0;
  while (begin <= name.size()) {
    std::size_t end = name.find('.', begin);
    if (end == std::string::npos) end = name.size();
    if (name.substr(begin, end - begin).find("norm") != std::string::npos) return true;
    begin = end + 1;
  }
  return false;
}

WeightDecaySplit split_for_weight_decay(const torch::nn::Module& module) {
  WeightDecaySplit split;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    (excluded_from_weight_decay(item.key()) ? split.no_decay_names : split.decay_names).push_back(item.key());
  }
  return split;
}

std::vector<torch::optim::OptimizerParamGroup> adamw_param_groups(const torch::nn::Module& module,
                                                                   const torch::optim::AdamWOptions& options) {
  std::vector<torch::Tensor> decay;
  std::vector<torch::Tensor> no_decay;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    (excluded_from_weight_decay(item.key()) ? no_decay : decay).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) {
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(options));
  }
  if (!no_decay.empty()) {
    auto no_decay_options = std::make_unique<torch::optim::AdamWOptions>(options);
    no_decay_options->weight_decay(0.0);
    groups.emplace_back(no_decay, std::move(no_decay_options));
  }
  return groups;
}

}  // namespace xpm
