#!/usr/bin/env bash
# Measured peak and the planner's prediction error per precision / activation-checkpointing mode
# (the benchmark table of docs/benchmarks.md). Runs xpm-train once per mode on the bundled task: the same seed,
# outer batches, steps and CPU cap factor, a fresh probe and fit per mode (no memory-model cache),
# then prints a Markdown table built from each run's summary.json (jq).
#
#   bench/precision_modes.sh BUILD_DIR WORK_DIR STEPS THREADS > table.md
#
# Columns: probes and probing time; the fitted activation coefficients a and b of the bundled
# formula a*bs*l^2 + b*bs*l + c (what each mode changes); static bytes (weights, gradients, AdamW state: the same in
# every mode, as the master weights stay float32); the largest measured step peak of allocated
# bytes and the cap; the planner's largest relative error of a step's predicted peak
# (|predicted - measured| / measured, summary max_step_prediction_rel_error) and how many steps
# it under-predicted; sentences per microbatch (64 x steps / microbatches: the planner fills the
# same budget, so a mode that needs less memory per sentence fits more); real tokens/s;
# held-out token accuracy at the end.
# Exit code 2 for bad arguments; a failed run stops the script with xpm-train's exit code.
set -euo pipefail
if [ $# -ne 4 ]; then
  echo "usage: bench/precision_modes.sh BUILD_DIR WORK_DIR STEPS THREADS" >&2
  exit 2
fi
build_dir=$1 work_dir=$2 steps=$3 threads=$4
train="$build_dir/bin/xpm-train"
[ -x "$train" ] || { echo "precision_modes.sh: error: no xpm-train at '$train' (BUILD_DIR)" >&2; exit 2; }
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "precision_modes.sh: error: STEPS must be >= 1, got '$steps'" >&2; exit 2; }
mkdir -p "$work_dir"

modes=("32-true" "32-true|--activation-checkpointing" "bf16-mixed" "bf16-mixed|--activation-checkpointing")
echo "| precision | activation checkpointing | probes (s) | fitted a (bytes per bs·l²) | fitted b (bytes per bs·l) | static bytes | max step peak bytes | peak / cap | max step prediction error | under-predicted steps | records per microbatch | real tokens/s | held-out accuracy |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for mode in "${modes[@]}"; do
  precision=${mode%%|*}
  extra=""
  [ "$mode" != "$precision" ] && extra=${mode#*|}
  name="$precision${extra:+-checkpointed}"
  # shellcheck disable=SC2086  # $extra is one option or nothing
  "$train" --run-dir "$work_dir/$name" --max-steps "$steps" --threads "$threads" --memory-cap-factor 2.0 \
    --outer-batch-size 64 --memory-model-cache '' --max-validation-sentences 500 --precision "$precision" $extra -q > "$work_dir/$name.log"
  jq -r -s --arg p "$precision" --arg c "$([ -n "$extra" ] && echo yes || echo no)" \
    '.[0] as $s | .[1].coefficients as $k |
     "| \($p) | \($c) | \($s.probes) (\($s.probe_s * 10 | round / 10) s) | \($k.a * 10 | round / 10) | \($k.b | round) | \($s.static_bytes) | \($s.peak_allocated_bytes) | \($s.peak_allocated_bytes / $s.capacity_bytes * 1000 | round / 1000) | \($s.max_step_prediction_rel_error * 100000 | round / 1000) % | \($s.underpredictions) | \($s.train_steps * 64 / $s.microbatches * 10 | round / 10) | \($s.tokens_per_s | round) | \($s.val_token_accuracy * 1000 | round / 1000) |"' \
    "$work_dir/$name/summary.json" "$work_dir/$name/memory_model.json"
done
