#include "xpm/trainer/distributed/sharded_optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/options/gradient_clipping.hpp"
#include "xpm/planner/enum_names.hpp"

namespace xpm {

namespace {

constexpr std::int64_t kShardFileFormat = 1;

void* state_key(const torch::Tensor& parameter) {
  return parameter.unsafeGetTensorImpl();  // torch::optim's state key
}

const torch::optim::AdamWOptions& adamw_options(const torch::optim::OptimizerParamGroup& group,
                                                const torch::optim::AdamWOptions& defaults) {
  return group.has_options() ? static_cast<const torch::optim::AdamWOptions&>(group.options()) : defaults;
}

torch::Tensor int64_tensor(const std::vector<std::int64_t>& values) {
  return torch::tensor(values, torch::kInt64);
}

std::int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key, const std::string& path) {
  torch::Tensor value;
  if (!archive.try_read(key, value) || value.numel() != 1) {
    throw std::invalid_argument("sharded optimizer state '" + path + "' has no '" + key +
                                "' entry: not a file ShardedAdamW::save_shard wrote");
  }
  return value.item<std::int64_t>();
}

void write_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  std::ostringstream bytes;
  archive.save_to(bytes);
  write_file_atomically(path, bytes.str());
}

}  // namespace

namespace {
constexpr EnumNames<ShardingStrategy, 2> kShardingNames{
    {{ShardingStrategy::kNoShard, "no_shard"}, {ShardingStrategy::kShardGradOp, "shard_grad_op"}}};
}  // namespace

ShardingStrategy parse_sharding_strategy(const std::string& text, const std::string& source) {
  if (text == "full_shard") {
    throw std::invalid_argument(
        source + ": 'full_shard' (parameters sharded too) is not supported: it needs an all-gather "
        "of each layer's parameters in every microbatch's forward and backward, so the number of "
        "collectives would depend on how many microbatches each rank runs, which differs between "
        "ranks (xpm's collectives are fixed per step, docs/design.md section 4); use shard_grad_op");
  }
  return parse_enum(kShardingNames, text, source);
}

std::string to_string(ShardingStrategy strategy) { return enum_name(kShardingNames, strategy); }

ShardLayout::ShardLayout(std::int64_t total, int world) : total_numel(total), world_size(world) {
  if (total < 0) throw std::invalid_argument("ShardLayout: total_numel must be >= 0, got " + std::to_string(total));
  if (world < 1) throw std::invalid_argument("ShardLayout: world_size must be >= 1, got " + std::to_string(world));
  shard_numel = (total + world - 1) / world;
}

std::int64_t ShardLayout::begin(int rank) const { return std::min(total_numel, rank * shard_numel); }
std::int64_t ShardLayout::end(int rank) const { return std::min(total_numel, (rank + 1) * shard_numel); }

void ShardedAdamWOptions::validate() const {
  if (world_size < 1) {
    throw std::invalid_argument("ShardedAdamWOptions.world_size must be >= 1, got " + std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("ShardedAdamWOptions.rank must be in [0, world_size " +
                                std::to_string(world_size) + "), got " + std::to_string(rank));
  }
  if (!(max_grad_norm >= 0) || !std::isfinite(max_grad_norm)) {
    throw std::invalid_argument("ShardedAdamWOptions.max_grad_norm must be finite and >= 0 (0: no clipping), got " +
                                std::to_string(max_grad_norm));
  }
}

ShardedAdamW::ShardedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           const torch::optim::AdamWOptions& defaults, const ShardedAdamWOptions& options,
                           DistributedContext* context)
    : options_(options), context_(context), layout_(0, 1) {
  options_.validate();
  if (context_ != nullptr &&
      (context_->rank() != options_.rank || context_->world_size() != options_.world_size)) {
    throw std::invalid_argument("ShardedAdamW: options say rank " + std::to_string(options_.rank) + " of " +
                                std::to_string(options_.world_size) + " but the context is rank " +
                                std::to_string(context_->rank()) + " of " + std::to_string(context_->world_size()));
  }
  torch::NoGradGuard no_grad;
  // Flat order: group by group, parameters in group order.
  std::int64_t total = 0;
  torch::Tensor first;
  for (const auto& group : param_groups) {
    std::size_t count = 0;
    for (const torch::Tensor& parameter : group.params()) {
      if (!parameter.requires_grad()) continue;
      if (!first.defined()) first = parameter;
      if (parameter.scalar_type() != first.scalar_type() || parameter.device() != first.device()) {
        throw std::invalid_argument(
            "ShardedAdamW: every parameter must share one dtype and device; parameter " +
            std::to_string(slots_.size()) + " of shape " + c10::str(parameter.sizes()) + " is " +
            c10::toString(parameter.scalar_type()) + " on " + parameter.device().str() + ", the first is " +
            c10::toString(first.scalar_type()) + " on " + first.device().str());
      }
      if (!at::isFloatingType(parameter.scalar_type())) {
        throw std::invalid_argument(std::string("ShardedAdamW: parameters must be floating point, got ") +
                                    c10::toString(parameter.scalar_type()));
      }
      slots_.push_back(Slot{parameter, total, parameter.numel(), torch::Tensor()});
      total += parameter.numel();
      ++count;
    }
    group_sizes_.push_back(count);
  }
  if (slots_.empty()) throw std::invalid_argument("ShardedAdamW: no parameter requires grad");

  const int owners = options_.strategy == ShardingStrategy::kNoShard ? 1 : options_.world_size;
  layout_ = ShardLayout(total, owners);
  const int owner = options_.strategy == ShardingStrategy::kNoShard ? 0 : options_.rank;
  owned_begin_ = layout_.begin(owner);
  owned_end_ = layout_.end(owner);

  // Flat buffers; each parameter (and its gradient) becomes a view. The parameter keeps its
  // TensorImpl (set_data), so modules, hooks and other references see the new storage.
  flat_parameters_ = torch::zeros({layout_.padded_numel()}, first.options().requires_grad(false));
  flat_gradients_ = torch::zeros({layout_.padded_numel()}, first.options().requires_grad(false));
  for (Slot& slot : slots_) {
    torch::Tensor view = flat_parameters_.narrow(0, slot.offset, slot.numel).view(slot.parameter.sizes());
    view.copy_(slot.parameter.detach());
    slot.parameter.set_data(view);
    slot.gradient_view = flat_gradients_.narrow(0, slot.offset, slot.numel).view(slot.parameter.sizes());
    if (slot.parameter.grad().defined()) slot.gradient_view.copy_(slot.parameter.grad());
    slot.parameter.mutable_grad() = slot.gradient_view;
  }

  // The owned range cut at group boundaries; one AdamW group per constructor group (possibly
  // empty), so group indices and options carry over.
  std::vector<torch::optim::OptimizerParamGroup> segment_groups;
  std::int64_t group_begin = 0;
  std::size_t slot_index = 0;
  for (std::size_t g = 0; g < param_groups.size(); ++g) {
    std::int64_t group_numel = 0;
    for (std::size_t i = 0; i < group_sizes_[g]; ++i) group_numel += slots_[slot_index++].numel;
    const std::int64_t begin = std::max(group_begin, owned_begin_);
    const std::int64_t end = std::min(group_begin + group_numel, owned_end_);
    std::vector<torch::Tensor> params;
    if (begin < end) {
      Segment segment{g, begin, end - begin, flat_parameters_.narrow(0, begin, end - begin)};
      segment.parameter.mutable_grad() = flat_gradients_.narrow(0, begin, end - begin);
      params.push_back(segment.parameter);
      segments_.push_back(segment);
    }
    segment_groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(
                                            adamw_options(param_groups[g], defaults)));
    group_begin += group_numel;
  }
  adamw_ = std::make_unique<torch::optim::AdamW>(segment_groups, defaults);
}

bool ShardedAdamW::collective() const { return context_ != nullptr && context_->distributed(); }

DistributedContext& ShardedAdamW::ownership_context() {
  return options_.strategy == ShardingStrategy::kShardGradOp && collective() ? *context_ : local_context_;
}

void ShardedAdamW::regraft_gradients() {
  for (Slot& slot : slots_) {
    const torch::Tensor& grad = slot.parameter.grad();
    if (grad.defined() && grad.data_ptr() == slot.gradient_view.data_ptr()) continue;
    if (grad.defined()) {
      slot.gradient_view.copy_(grad);
    } else {
      slot.gradient_view.zero_();
    }
    slot.parameter.mutable_grad() = slot.gradient_view;
    ++regrafted_gradients_;
  }
}

void ShardedAdamW::zero_grad() {
  torch::NoGradGuard no_grad;
  for (Slot& slot : slots_) {
    const torch::Tensor& grad = slot.parameter.grad();
    if (!grad.defined() || grad.data_ptr() != slot.gradient_view.data_ptr()) {
      slot.parameter.mutable_grad() = slot.gradient_view;
      ++regrafted_gradients_;
    }
  }
  flat_gradients_.zero_();
}

void ShardedAdamW::reduce_gradients() {
  torch::NoGradGuard no_grad;
  regraft_gradients();
  if (collective()) context_->all_reduce_(flat_gradients_, ReduceOp::kSum);
}

ShardedStepResult ShardedAdamW::clip_gradients(double max_norm) {
  ShardedStepResult result;
  result.gradient_norm = clip_gradient_norm_(owned_gradients(), max_norm, ownership_context());
  result.clipped = result.gradient_norm + 1e-6 > max_norm;
  return result;
}

void ShardedAdamW::step_owned() {
  allocate_state();
  adamw_->step();
  ++steps_;
}

void ShardedAdamW::gather_parameters() {
  if (options_.strategy != ShardingStrategy::kShardGradOp || !collective()) return;
  torch::NoGradGuard no_grad;
  // Everything but the owned slice to zero, then a sum over ranks: each element has exactly
  // one non-zero contribution, its owner's, and x + 0 = x.
  flat_parameters_.narrow(0, 0, owned_begin_).zero_();
  flat_parameters_.narrow(0, owned_end_, layout_.padded_numel() - owned_end_).zero_();
  context_->all_reduce_(flat_parameters_, ReduceOp::kSum);
}

ShardedStepResult ShardedAdamW::step() {
  reduce_gradients();
  ShardedStepResult result;
  if (options_.max_grad_norm > 0) result = clip_gradients(options_.max_grad_norm);
  step_owned();
  gather_parameters();
  return result;
}

ShardedStepResult ShardedAdamW::step_local() {
  {
    torch::NoGradGuard no_grad;
    regraft_gradients();
  }
  ShardedStepResult result;
  if (options_.max_grad_norm > 0) {
    result.gradient_norm = clip_gradient_norm_(owned_gradients(), options_.max_grad_norm, local_context_);
    result.clipped = result.gradient_norm + 1e-6 > options_.max_grad_norm;
  }
  step_owned();
  return result;
}

std::vector<torch::Tensor> ShardedAdamW::owned_gradients() const {
  std::vector<torch::Tensor> out;
  for (const Segment& segment : segments_) out.push_back(segment.parameter.grad());
  return out;
}

void ShardedAdamW::set_learning_rate(double lr) {
  for (auto& group : adamw_->param_groups()) group.options().set_lr(lr);
}

void ShardedAdamW::allocate_state() {
  if (exp_avg_.defined()) return;
  torch::NoGradGuard no_grad;
  const std::int64_t owned = owned_end_ - owned_begin_;
  const auto options = flat_parameters_.options();
  exp_avg_ = torch::zeros({owned}, options);
  exp_avg_sq_ = torch::zeros({owned}, options);
  bool amsgrad = false;
  for (const auto& group : adamw_->param_groups()) {
    amsgrad = amsgrad || static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad();
  }
  if (amsgrad) max_exp_avg_sq_ = torch::zeros({owned}, options);
  for (const Segment& segment : segments_) {
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(steps_);
    state->exp_avg(exp_avg_.narrow(0, segment.begin - owned_begin_, segment.numel));
    state->exp_avg_sq(exp_avg_sq_.narrow(0, segment.begin - owned_begin_, segment.numel));
    if (amsgrad) state->max_exp_avg_sq(max_exp_avg_sq_.narrow(0, segment.begin - owned_begin_, segment.numel));
    adamw_->state()[state_key(segment.parameter)] = std::move(state);
  }
}

void ShardedAdamW::reset_state() {
  if (!exp_avg_.defined()) return;
  torch::NoGradGuard no_grad;
  exp_avg_.zero_();
  exp_avg_sq_.zero_();
  if (max_exp_avg_sq_.defined()) max_exp_avg_sq_.zero_();
  steps_ = 0;
  for (auto& entry : adamw_->state()) static_cast<torch::optim::AdamWParamState&>(*entry.second).step(0);
}

std::int64_t ShardedAdamW::state_bytes() const {
  std::int64_t bytes = 0;
  for (const torch::Tensor& t : {exp_avg_, exp_avg_sq_, max_exp_avg_sq_}) {
    if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
  }
  return bytes;
}

void ShardedAdamW::save_shard(const std::string& path) const {
  torch::serialize::OutputArchive archive;
  std::vector<std::int64_t> numels;
  for (const Slot& slot : slots_) numels.push_back(slot.numel);
  archive.write("format", int64_tensor({kShardFileFormat}));
  archive.write("rank", int64_tensor({options_.rank}));
  archive.write("world_size", int64_tensor({options_.world_size}));
  archive.write("strategy", int64_tensor({static_cast<std::int64_t>(options_.strategy)}));
  archive.write("owned_range", int64_tensor({owned_begin_, owned_end_}));
  archive.write("parameter_numels", int64_tensor(numels));
  archive.write("steps", int64_tensor({steps_}));
  const std::int64_t owned = owned_end_ - owned_begin_;
  const auto options = flat_parameters_.options();
  archive.write("exp_avg", exp_avg_.defined() ? exp_avg_ : torch::zeros({owned}, options));
  archive.write("exp_avg_sq", exp_avg_sq_.defined() ? exp_avg_sq_ : torch::zeros({owned}, options));
  if (max_exp_avg_sq_.defined()) archive.write("max_exp_avg_sq", max_exp_avg_sq_);
  write_archive_atomically(archive, path);
}

void ShardedAdamW::load_shard(const std::string& path) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& error) {
    throw std::runtime_error("cannot read sharded optimizer state '" + path + "': " + error.what_without_backtrace());
  }
  if (read_int(archive, "format", path) != kShardFileFormat) {
    throw std::invalid_argument("sharded optimizer state '" + path + "' has format " +
                                std::to_string(read_int(archive, "format", path)) + ", expected " +
                                std::to_string(kShardFileFormat));
  }
  const std::int64_t world = read_int(archive, "world_size", path);
  const std::int64_t rank = read_int(archive, "rank", path);
  const std::int64_t strategy = read_int(archive, "strategy", path);
  if (world != options_.world_size || rank != options_.rank ||
      strategy != static_cast<std::int64_t>(options_.strategy)) {
    throw std::invalid_argument(
        "sharded optimizer state '" + path + "' was written by rank " + std::to_string(rank) + " of world size " +
        std::to_string(world) + " (" + to_string(static_cast<ShardingStrategy>(strategy)) + "), this is rank " +
        std::to_string(options_.rank) + " of world size " + std::to_string(options_.world_size) + " (" +
        to_string(options_.strategy) + "); resume from a full state (save_full_state) to change the world size");
  }
  torch::Tensor numels;
  archive.read("parameter_numels", numels);
  std::vector<std::int64_t> expected;
  for (const Slot& slot : slots_) expected.push_back(slot.numel);
  if (!torch::equal(numels, int64_tensor(expected))) {
    throw std::invalid_argument("sharded optimizer state '" + path +
                                "' was written for other parameters (element counts differ)");
  }
  allocate_state();
  torch::NoGradGuard no_grad;
  torch::Tensor value;
  archive.read("exp_avg", value);
  exp_avg_.copy_(value);
  archive.read("exp_avg_sq", value);
  exp_avg_sq_.copy_(value);
  if (max_exp_avg_sq_.defined()) {
    if (!archive.try_read("max_exp_avg_sq", value)) {
      throw std::invalid_argument("sharded optimizer state '" + path + "' has no max_exp_avg_sq but amsgrad is on");
    }
    max_exp_avg_sq_.copy_(value);
  }
  steps_ = read_int(archive, "steps", path);
  for (auto& entry : adamw_->state()) static_cast<torch::optim::AdamWParamState&>(*entry.second).step(steps_);
}

std::unique_ptr<torch::optim::AdamW> ShardedAdamW::full_optimizer() const {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::size_t slot = 0;
  for (std::size_t g = 0; g < group_sizes_.size(); ++g) {
    std::vector<torch::Tensor> params;
    for (std::size_t i = 0; i < group_sizes_[g]; ++i) params.push_back(slots_[slot++].parameter);
    groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(
                                    static_cast<const torch::optim::AdamWOptions&>(adamw_->param_groups()[g].options())));
  }
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions());
}

void ShardedAdamW::save_full_state(const std::string& path) {
  torch::NoGradGuard no_grad;
  // Every rank writes its owned slices into zeroed full-size buffers; a sum over the owners
  // assembles them (one all-reduce per buffer). The step count: max over ranks (a rank may own
  // nothing).
  const auto options = flat_parameters_.options();
  const bool amsgrad = max_exp_avg_sq_.defined();
  std::vector<torch::Tensor> full;
  for (const torch::Tensor* owned : {&exp_avg_, &exp_avg_sq_, &max_exp_avg_sq_}) {
    if (owned == &max_exp_avg_sq_ && !amsgrad) break;
    torch::Tensor buffer = torch::zeros({layout_.padded_numel()}, options);
    if (owned->defined()) buffer.narrow(0, owned_begin_, owned_end_ - owned_begin_).copy_(*owned);
    ownership_context().all_reduce_(buffer, ReduceOp::kSum);  // no-op unless sharded over ranks
    full.push_back(buffer);
  }
  const double steps = ownership_context().all_reduce({static_cast<double>(steps_)}, ReduceOp::kMax)[0];
  if (context_ != nullptr && context_->rank() != 0) return;
  std::unique_ptr<torch::optim::AdamW> optimizer = full_optimizer();
  if (steps > 0) {
    for (const Slot& slot : slots_) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(static_cast<std::int64_t>(steps));
      // Clones: a view would be saved with its whole storage.
      state->exp_avg(full[0].narrow(0, slot.offset, slot.numel).view(slot.parameter.sizes()).clone());
      state->exp_avg_sq(full[1].narrow(0, slot.offset, slot.numel).view(slot.parameter.sizes()).clone());
      if (amsgrad) {
        state->max_exp_avg_sq(full[2].narrow(0, slot.offset, slot.numel).view(slot.parameter.sizes()).clone());
      }
      optimizer->state()[state_key(slot.parameter)] = std::move(state);
    }
  }
  torch::serialize::OutputArchive archive;
  optimizer->save(archive);
  write_archive_atomically(archive, path);
}

void ShardedAdamW::load_full_state(const std::string& path) {
  std::unique_ptr<torch::optim::AdamW> optimizer = full_optimizer();
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    optimizer->load(archive);
  } catch (const c10::Error& error) {
    throw std::invalid_argument("cannot load the full optimizer state '" + path +
                                "' into these parameter groups: " + error.what_without_backtrace());
  } catch (const std::exception& error) {
    throw std::invalid_argument("cannot load the full optimizer state '" + path +
                                "' into these parameter groups: " + error.what());
  }
  allocate_state();
  torch::NoGradGuard no_grad;
  std::int64_t steps = 0;
  for (const Slot& slot : slots_) {
    const auto found = optimizer->state().find(state_key(slot.parameter));
    if (found == optimizer->state().end()) continue;  // never stepped: zeros
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(*found->second);
    if (state.exp_avg().numel() != slot.numel) {
      throw std::invalid_argument("full optimizer state '" + path + "': parameter of shape " +
                                  c10::str(slot.parameter.sizes()) + " has state of shape " +
                                  c10::str(state.exp_avg().sizes()));
    }
    steps = std::max(steps, state.step());
    const std::int64_t begin = std::max(slot.offset, owned_begin_);
    const std::int64_t end = std::min(slot.offset + slot.numel, owned_end_);
    if (begin >= end) continue;
    const auto piece = [&](const torch::Tensor& t) { return t.reshape({-1}).narrow(0, begin - slot.offset, end - begin); };
    exp_avg_.narrow(0, begin - owned_begin_, end - begin).copy_(piece(state.exp_avg()));
    exp_avg_sq_.narrow(0, begin - owned_begin_, end - begin).copy_(piece(state.exp_avg_sq()));
    if (max_exp_avg_sq_.defined() && state.max_exp_avg_sq().defined()) {
      max_exp_avg_sq_.narrow(0, begin - owned_begin_, end - begin).copy_(piece(state.max_exp_avg_sq()));
    }
  }
  steps_ = steps;
  for (auto& entry : adamw_->state()) static_cast<torch::optim::AdamWParamState&>(*entry.second).step(steps_);
}

}  // namespace xpm
