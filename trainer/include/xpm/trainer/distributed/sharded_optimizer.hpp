// xpm/trainer/distributed/sharded_optimizer.hpp — AdamW whose state is sharded over the ranks of a
// data-parallel job (ZeRO stage 1/2, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
// Training Trillion Parameter Models"), on c10d through DistributedContext.
//
//   auto groups = adamw_param_groups(*model, torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
//   ShardedAdamWOptions options;                 // shard_grad_op, this rank of world_size
//   options.rank = dist.rank();
//   options.world_size = dist.world_size();
//   options.max_grad_norm = 1.0;                 // global-norm clipping (0: none)
//   ShardedAdamW optimizer(groups, torch::optim::AdamWOptions(3e-3), options, &dist);
//   ... optimizer.zero_grad(); microbatches' forward/backward accumulate into .grad ...
//   optimizer.set_learning_rate(learning_rate_at(schedule, step));
//   ShardedStepResult r = optimizer.step();      // collective: every rank, once per step
//
// Layout. The trainable parameters, in param-group order, are copied into one flat buffer and
// each parameter becomes a view of it (its .grad too, into a flat gradient buffer), so nothing
// is copied per step. The flat vector is padded to world_size x shard_numel elements, shard_numel
// = ceil(total / world_size); rank r owns elements [r * shard_numel, (r + 1) * shard_numel) and
// keeps AdamW state (exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad) for those only: the
// state is 1/world_size of an unsharded AdamW's. The owned range is cut at group boundaries into
// at most one segment per group, and a torch::optim::AdamW steps those segments with their
// group's options, so the update is LibTorch's AdamW, element for element.
//
// One step (ShardedAdamW::step), the same collective sequence on every rank:
//   1. gradients summed over the ranks: one in-place all-reduce of the flat gradient buffer;
//   2. with max_grad_norm > 0, clipping by the global norm of the reduced gradient: the owned
//      slices' squared sums, one all-reduce (gradient_clipping.hpp);
//   3. AdamW on the owned segments only;
//   4. all-gather of the updated parameters: every rank zeroes what it does not own and one
//      in-place all-reduce (sum) of the flat parameter buffer puts every rank's slice everywhere
//      (x + 0 = x exactly, so every rank ends with bit-identical parameters).
// Why all-reduce for 1 and 4: ProcessGroupGloo in LibTorch 1.13 has no reduce_scatter ("does not
// support reduce_scatter") nor _allgather_base, and its list allgather allocates a full-size
// temporary; the in-place all-reduce allocates nothing through c10 (it moves 2x the bytes of a
// reduce-scatter / all-gather over the wire). Memory consequence: every rank holds the full
// parameters (as DDP) and the full local gradient (gradient accumulation over a rank's
// microbatches sums into it before the single reduction of the step, docs/design.md section 4), so
// the per-rank saving is the optimizer state: 8 bytes per float32 element become
// 8 / world_size. docs/precision-and-sharding.md maps this to FSDP's strategies.
//
// Probes: a ShardedAdamW built with context == nullptr simulates `rank` of `world_size`: it
// allocates exactly what that rank holds and runs the same step without collectives, so rank
// 0 can measure a sharded rank's memory alone (docs/precision-and-sharding.md, "The planner").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/distributed/distributed.hpp"

namespace xpm {

/// Mapped to PyTorch FSDP's ShardingStrategy names (docs/precision-and-sharding.md).
enum class ShardingStrategy {
  kNoShard,      // every rank holds the whole AdamW state (DDP)
  kShardGradOp,  // each rank reduces the gradient for, and keeps the state of, its shard only
};

/// "no_shard" | "shard_grad_op" -> the strategy. Throws std::invalid_argument naming the text and
/// `source` (e.g. "--sharding") otherwise; for "full_shard" the message says why xpm does not
/// shard parameters (per-layer all-gathers in every microbatch would make the number of
/// collectives depend on each rank's microbatch count).
ShardingStrategy parse_sharding_strategy(const std::string& text, const std::string& source);
/// The name parse_sharding_strategy accepts.
std::string to_string(ShardingStrategy strategy);

/// The owned ranges: rank r owns [begin(r), end(r)) of the flat parameter vector.
struct ShardLayout {
  std::int64_t total_numel = 0;  // trainable parameter elements
  int world_size = 1;
  std::int64_t shard_numel = 0;  // ceil(total_numel / world_size); the last ranks may own less
  /// Throws std::invalid_argument when total_numel < 0 or world_size < 1.
  ShardLayout(std::int64_t total_numel, int world_size);
  std::int64_t begin(int rank) const;
  std::int64_t end(int rank) const;
  std::int64_t padded_numel() const { return shard_numel * world_size; }
};

struct ShardedAdamWOptions {
  ShardingStrategy strategy = ShardingStrategy::kShardGradOp;
  int rank = 0;               // this rank, or the rank a probe simulates
  int world_size = 1;         // ranks sharing the state
  double max_grad_norm = 0;   // clip the global gradient norm to this before AdamW (0: no clipping)
  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
};

struct ShardedStepResult {
  double gradient_norm = 0;  // global norm before clipping (0 when max_grad_norm is 0)
  bool clipped = false;      // the gradient was scaled down
};

class ShardedAdamW {
 public:
  /// Flattens the trainable parameters of `param_groups` (those requiring grad; order: group,
  /// then position) as described above and makes them and their gradients views of the flat
  /// buffers (an existing .grad is copied in). Groups without options use `defaults`. The state
  /// is allocated on the first step or by allocate_state(). `context`: the job's context, whose
  /// rank and world size must equal options' (every rank then calls step() together), or
  /// nullptr to simulate options.rank without collectives (probes). Every rank must pass the
  /// same groups in the same order. Throws std::invalid_argument for bad options, a context
  /// that disagrees with them, no trainable parameter, or parameters of different dtypes or
  /// devices (naming them).
  ShardedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
               const torch::optim::AdamWOptions& defaults, const ShardedAdamWOptions& options,
               DistributedContext* context);
  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  /// Zeroes the whole flat gradient in place (every parameter's .grad, owned or not); re-points a
  /// .grad replaced by other code into its view. Not collective.
  void zero_grad();
  /// Steps 1-4 above. Collective (with a context): every rank calls it once per optimizer step,
  /// including ranks that ran no microbatch. Throws DistributedError when a collective fails.
  ShardedStepResult step();

  /// step() without collectives, for a probe on one rank of a running job (rank 0 measures
  /// while the others wait): the same allocations as step() (the in-place all-reduces allocate
  /// nothing through c10), clipping by this rank's shard only, other ranks' shards not updated.
  /// Not collective. Reset the state afterwards (reset_state()) if training follows.
  ShardedStepResult step_local();

  // The four phases of step(), in that order, for callers that act between them (loss
  // scaling checks the reduced gradient for inf/nan before clipping and stepping). Each of
  // reduce_gradients(), clip_gradients() and gather_parameters() is collective.
  void reduce_gradients();
  ShardedStepResult clip_gradients(double max_norm);
  void step_owned();
  void gather_parameters();

  /// The reduced gradient of the owned segments (views; valid after reduce_gradients()): the
  /// shards to pass to clip_gradient_norm_ or DynamicLossScaler::unscale_.
  std::vector<torch::Tensor> owned_gradients() const;
  /// The context whose collectives span the shard owners: the job's for shard_grad_op, a
  /// single-process one when every rank owns everything (no_shard) or when simulating.
  DistributedContext& ownership_context();

  /// Sets every group's learning rate (schedules set it before each step).
  void set_learning_rate(double lr);
  /// Allocates the AdamW state of the owned elements (zeros, step 0) if not allocated yet.
  void allocate_state();
  /// Back to step 0 and zero moments without freeing the state (after probing).
  void reset_state();
  /// Bytes of AdamW state this rank holds (0 before allocation): 2 (3 with amsgrad) x owned
  /// elements x element size.
  std::int64_t state_bytes() const;

  /// This rank's state in a file (written atomically): the layout it was written under and the
  /// owned slices. Not collective; every rank writes its own path.
  void save_shard(const std::string& path) const;
  /// Reads a file save_shard wrote for this rank. Throws std::invalid_argument naming the path
  /// when it was written for another rank, world size, strategy or parameter layout (use a full
  /// state to change the world size), std::runtime_error when it cannot be read.
  void load_shard(const std::string& path);
  /// Gathers the whole AdamW state (collective: every rank calls it; each transiently holds the
  /// full state, 2-3 x the parameters' bytes) and, on rank 0, writes it atomically to `path` as
  /// a plain torch::optim::AdamW over the original parameters with these groups, which
  /// torch::load(adamw, path) loads at any world size, including one process.
  void save_full_state(const std::string& path);
  /// Loads a full state (save_full_state's, or torch::save of a plain AdamW built over the same
  /// parameter groups) and keeps the owned slices. Not collective. Throws std::invalid_argument
  /// naming the path when its groups or parameter shapes differ, std::runtime_error when it
  /// cannot be read.
  void load_full_state(const std::string& path);

  const ShardLayout& layout() const { return layout_; }
  const ShardedAdamWOptions& options() const { return options_; }
  /// First and one-past-last owned element of the flat vector.
  std::int64_t owned_begin() const { return owned_begin_; }
  std::int64_t owned_end() const { return owned_end_; }
  /// Optimizer steps taken (AdamW's step count).
  std::int64_t steps() const { return steps_; }
  /// The AdamW over the owned segments (its groups mirror the constructor's).
  torch::optim::AdamW& adamw() { return *adamw_; }
  /// How many times a replaced .grad was copied back into its view (0 in normal training).
  std::int64_t regrafted_gradients() const { return regrafted_gradients_; }

 private:
  struct Slot {
    torch::Tensor parameter;  // the model's parameter (a view of flat_parameters_)
    std::int64_t offset = 0;  // first element in the flat vector
    std::int64_t numel = 0;
    torch::Tensor gradient_view;
  };
  struct Segment {
    std::size_t group = 0;
    std::int64_t begin = 0;  // flat index
    std::int64_t numel = 0;
    torch::Tensor parameter;  // view of flat_parameters_, the AdamW's parameter
  };
  bool collective() const;
  void regraft_gradients();
  /// A plain AdamW over the original parameters with this optimizer's groups and options.
  std::unique_ptr<torch::optim::AdamW> full_optimizer() const;

  ShardedAdamWOptions options_;
  DistributedContext* context_;       // null: simulation
  DistributedContext local_context_;  // single process, for no_shard and simulation
  ShardLayout layout_;
  std::int64_t owned_begin_ = 0;
  std::int64_t owned_end_ = 0;
  std::vector<Slot> slots_;                 // flat order
  std::vector<std::size_t> group_sizes_;    // trainable parameters per group
  torch::Tensor flat_parameters_;           // [padded_numel]
  torch::Tensor flat_gradients_;            // [padded_numel]
  torch::Tensor exp_avg_;                   // [owned_end - owned_begin], undefined before allocation
  torch::Tensor exp_avg_sq_;
  torch::Tensor max_exp_avg_sq_;            // amsgrad only
  std::vector<Segment> segments_;           // owned range cut at group boundaries
  std::unique_ptr<torch::optim::AdamW> adamw_;
  std::int64_t steps_ = 0;
  std::int64_t regrafted_gradients_ = 0;
};

}  // namespace xpm
