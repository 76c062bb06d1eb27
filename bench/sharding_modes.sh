#!/usr/bin/env bash
# Measured peak and the planner's prediction error per sharding mode (the benchmark table of docs/benchmarks.md):
# xpm-train on the bundled task at world 1 (no_shard) and world 2 (no_shard, shard_grad_op; gloo
# over loopback, THREADS intra-op threads per rank). The same seed, outer batches (64), steps and
# CPU cap in bytes per rank in every mode, a fresh probe and fit per mode (no memory-model cache);
# prints a Markdown table built from each run's summary.json and memory_model.json (jq).
#
#   bench/sharding_modes.sh BUILD_DIR WORK_DIR STEPS THREADS CAP_BYTES > table.md
#
# Columns: world size and sharding; probes and probing time (rank 0 probes what a rank of this
# world holds); AdamW state bytes and static bytes (meter: weights, gradients, AdamW state) of
# each rank, "r0 / r1"; the fitted constant c of a*bs*l^2 + b*bs*l + c (the static bytes the plan
# starts from); the largest step peak of allocated bytes over the ranks and its share of the
# cap; the largest relative error of a step's predicted peak (summary
# max_step_prediction_rel_error) and the under-predicted steps; sentences per microbatch (64 x
# steps / microbatches of all ranks: the room sharding frees goes to larger microbatches); real
# tokens/s; held-out token accuracy at the end.
# Exit code 2 for bad arguments; a failed run stops the script with xpm-train's exit code.
set -euo pipefail
if [ $# -ne 5 ]; then
  echo "usage: bench/sharding_modes.sh BUILD_DIR WORK_DIR STEPS THREADS CAP_BYTES" >&2
  exit 2
fi
build_dir=$1 work_dir=$2 steps=$3 threads=$4 cap_bytes=$5
train="$build_dir/bin/xpm-train"
[ -x "$train" ] || { echo "sharding_modes.sh: error: no xpm-train at '$train' (BUILD_DIR)" >&2; exit 2; }
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "sharding_modes.sh: error: STEPS must be >= 1, got '$steps'" >&2; exit 2; }
[[ "$cap_bytes" =~ ^[1-9][0-9]*$ ]] ||
  { echo "sharding_modes.sh: error: CAP_BYTES must be >= 1, got '$cap_bytes'" >&2; exit 2; }
mkdir -p "$work_dir"

modes=("1|no_shard" "2|no_shard" "2|shard_grad_op")
echo "| world size | sharding | probes (s) | AdamW state bytes per rank | static bytes per rank | fitted c (bytes) | max step peak bytes | peak / cap | max step prediction error | under-predicted steps | records per microbatch | real tokens/s | held-out accuracy |"
echo "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for mode in "${modes[@]}"; do
  world=${mode%%|*} sharding=${mode#*|}
  name="world$world-$sharding"
  "$train" --run-dir "$work_dir/$name" --max-steps "$steps" --threads "$threads" --memory-cap-bytes "$cap_bytes" \
    --outer-batch-size 64 --memory-model-cache '' --max-validation-sentences 500 --nproc "$world" \
    --sharding "$sharding" -q > "$work_dir/$name.log"
  jq -r -s '.[0] as $s | .[1].coefficients as $k |
     "| \($s.world_size) | \($s.sharding) | \($s.probes) (\($s.probe_s * 10 | round / 10) s) | \($s.optimizer_state_bytes_per_rank | map(tostring) | join(" / ")) | \($s.static_bytes_per_rank | map(tostring) | join(" / ")) | \($k.c | round) | \($s.peak_allocated_bytes) | \($s.peak_allocated_bytes / $s.capacity_bytes * 1000 | round / 1000) | \($s.max_step_prediction_rel_error * 100000 | round / 1000) % | \($s.underpredictions) | \($s.train_steps * 64 / $s.microbatches * 10 | round / 10) | \($s.tokens_per_s | round) | \($s.val_token_accuracy * 1000 | round / 1000) |"' \
    "$work_dir/$name/summary.json" "$work_dir/$name/memory_model.json"
done
