#!/usr/bin/env bash
# The CUDA check, run on a lent GPU machine (docs/cuda.md). Prepare here first with
# tools/device-prep.sh, then from the device tool:
#   run(command="tools/device-check.sh", carry=[".device"], timeout_s=540)
# Stages (each logged to $OUT/device-check.log; a failing stage stops the script, rc != 0):
#   1. unpack the carried Debian packages into /tmp/xpm-prefix; check the machine's PyTorch
#      (python3's torch, 2.11 on the GPU image; xpm supports 2.11 to 2.14) and its CUDA
#   2. configure against that torch's LibTorch (XPM_WITH_CUDA must be ON) and build
#      planner_torch_tests, xpm-train,
#      heldout-prediction, xpm-plan (ninja, all cores)
#   3. the CUDA tests: planner_torch_tests (CudaMemoryMeter against the caching allocator)
#   4. held-out prediction error of the memory model on the GPU (table)
#   5. the bundled task for a fixed number of steps under a memory cap, fixed vs predictive
#      batching: OOM count, peak vs cap, real tokens/s (from each run's summary.json)
# Budget: about 8 minutes of device time; XPM_DEVICE_STEPS (default 150) sets the steps per run.
# Rehearsal on a machine without a GPU: XPM_DEVICE_KIND=cpu runs the same stages with
# --device cpu (no nvidia-smi, no CUDA LibTorch required; the CUDA meter's tests skip
# themselves), e.g. XPM_DEVICE_KIND=cpu XPM_DEVICE_STEPS=10 tools/device-check.sh.
set -uo pipefail
if [ $# -gt 0 ]; then
  echo "device-check.sh: error: unexpected argument '$1' (it takes no arguments; see the top of tools/device-check.sh)" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/xpm-device-out}
mkdir -p "$OUT"
log_file="$OUT/device-check.log"
steps=${XPM_DEVICE_STEPS:-150}
kind=${XPM_DEVICE_KIND:-cuda}
case "$kind" in
  cuda|cpu) ;;
  *) echo "device-check.sh: error: XPM_DEVICE_KIND must be cuda or cpu, got '$kind'" >&2; exit 2 ;;
esac
prefix=/tmp/xpm-prefix
build=/tmp/xpm-build-cuda
start_s=$(date +%s)

say() { echo "device-check [$(( $(date +%s) - start_s )) s]: $*" | tee -a "$log_file"; }
fail() { say "error: $*"; exit 1; }
stage() { say "== $*"; }

stage "1. packages and LibTorch"
[ -d .device/debs ] || fail ".device/debs missing: run tools/device-prep.sh here and carry .device"
mkdir -p "$prefix"
for deb in .device/debs/*.deb; do dpkg -x "$deb" "$prefix" || fail "cannot unpack $deb"; done
multiarch="$prefix/usr/lib/x86_64-linux-gnu"
# dpkg -x runs no maintainer scripts, so the BLAS/LAPACK alternatives symlinks are missing:
# point the loader at the ATLAS copies Ceres was linked against.
export LD_LIBRARY_PATH="$multiarch:$multiarch/atlas:${LD_LIBRARY_PATH:-}"
export PKG_CONFIG_PATH="$multiarch/pkgconfig:$prefix/usr/share/pkgconfig"
export PKG_CONFIG_SYSROOT_DIR="$prefix"
python=${PYTHON:-python3}
"$python" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if (2, 11) <= v < (2, 15) else 1)' ||
  fail "$python's torch $("$python" -c 'import torch; print(torch.__version__)' 2>&1) is not one xpm supports (2.11 to 2.14)"
if [ "$kind" = cuda ]; then
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0))' | tee -a "$log_file"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log_file"
else
  "$python" -c 'import torch; print("torch", torch.__version__, "(rehearsal on the CPU)")' | tee -a "$log_file"
fi

stage "2. configure and build (the LibTorch inside $python's torch)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DXPM_PYTHON_EXECUTABLE="$(command -v "$python")" -DCMAKE_PREFIX_PATH="$prefix/usr;$multiarch/cmake" \
  -DXPM_GLOO_INCLUDE_DIR="$prefix/usr/include" >>"$log_file" 2>&1 ||
  fail "configure failed (see the log)"
[ "$kind" = cpu ] || grep -q "xpm: CUDA LibTorch" "$log_file" || fail "CMake did not find a CUDA LibTorch"
cmake --build "$build" -j "$(nproc)" --target planner_torch_tests xpm-train heldout-prediction xpm-plan \
  >>"$log_file" 2>&1 || { tail -40 "$log_file"; fail "build failed"; }

stage "3. CUDA tests (on the CPU: the CUDA meter's skip themselves)"
"$build/bin/planner_torch_tests" 2>&1 | tee -a "$log_file" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "planner_torch_tests failed"

stage "4. held-out prediction error on the GPU"
"$build/bin/heldout-prediction" --data-dir .device/brown --device "$kind" \
  --json "$OUT/heldout.json" 2>&1 | tee -a "$log_file" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "heldout-prediction failed"

stage "5. the bundled task, $steps steps under a memory cap: fixed vs predictive"
run_job() {  # name, extra options...
  local name=$1
  shift
  "$build/bin/xpm-train" --data-dir .device/brown --device "$kind" --run-dir "/tmp/xpm-runs/$name" \
    --max-steps "$steps" --memory-cap-factor 2 --memory-fraction 0.9 \
    --max-validation-sentences 2000 --memory-model-cache "" --log-every 50 "$@" \
    >>"$log_file" 2>&1 || fail "xpm-train ($name) failed"
  cp "/tmp/xpm-runs/$name/summary.json" "$OUT/summary-$name.json"
}
run_job predictive --batcher predictive --packer adaptive --sort-by l
# The fixed batcher's microbatch: the largest that fits at the longest sentence, from the
# memory model the predictive run fitted (xpm-plan max-batch; the issue's batcher 1).
longest=$(grep -o "longest sentence [0-9]* tokens" "$log_file" | tail -1 | grep -o "[0-9]*") ||
  fail "no 'longest sentence' line in the predictive run's log"
cap=$("$python" -c 'import json; print(json.load(open("'"$OUT"'/summary-predictive.json"))["capacity_bytes"])')
fixed_size=$("$build/bin/xpm-plan" max-batch --model /tmp/xpm-runs/predictive/memory_model.json \
  --dims "l=$longest" --capacity-bytes "$cap" --memory-fraction 0.9 --json |
  "$python" -c 'import json, sys; print(json.load(sys.stdin)["max_microbatch_size"])') ||
  fail "xpm-plan max-batch failed"
say "fixed microbatch size $fixed_size (largest that fits at l = $longest)"
run_job fixed --batcher fixed --microbatch-size "$fixed_size"
"$python" - "$OUT" <<'PY' | tee -a "$log_file"
import json, sys
out = sys.argv[1]
print(f"{'batcher':<12}{'OOMs':>6}{'peak MiB':>10}{'cap MiB':>10}{'peak/cap':>9}{'tokens/s':>11}{'val acc':>9}")
for name in ("fixed", "predictive"):
    s = json.load(open(f"{out}/summary-{name}.json"))
    peak, cap = s["peak_allocated_bytes"], s["capacity_bytes"]
    print(f"{name:<12}{s['ooms']:>6}{peak/2**20:>10.1f}{cap/2**20:>10.1f}{peak/cap:>9.3f}"
          f"{s['tokens_per_s']:>11.0f}{s['val_token_accuracy']:>9.4f}")
PY
say "done in $(( $(date +%s) - start_s )) s"
