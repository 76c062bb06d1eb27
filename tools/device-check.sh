#!/usr/bin/env bash
# The CUDA check, run on a GPU machine (docs/cuda.md). Prepare on a Debian machine first with
# tools/device-prep.sh, then copy the checkout with .device/ to the GPU machine and run
#   tools/device-check.sh            (the log and results go to $OUT, default /tmp/xpm-device-out)
# Stages (each logged to $OUT/device-check.log; a failing stage 1 or 2 stops the script, stages 3
# to 5 run whatever the others did; rc != 0 after any error):
#   1. unpack the carried Debian packages into /tmp/xpm-prefix; check the machine's PyTorch
#      (python3's torch, 2.11 on the GPU image; xpm supports 2.11 to 2.14) and its CUDA
#   2. configure against that torch's LibTorch (XPM_WITH_CUDA must be ON) and build
#      planner_torch_tests, the installed libraries and programs, and the Python package
#      (ninja, all cores); install into /tmp/xpm-install
#   3. the CUDA tests: planner_torch_tests' CUDA meter cases (CudaMemoryMeter against the
#      caching allocator); then the shared allocation sequences (tests/caching_allocator/)
#      replayed against the real allocator, their bytes next to the emulation's
#      ($OUT/allocation-sequences-<kind>.json)
#   4. a user's C++ model on the GPU: examples/conv_genre_classifier built against the
#      installed xpm (find_package), trained by the Learner under a memory cap
#   5. a user's Python model on the GPU: examples/hf_trainer_causal_lm, a byte Llama of 105M
#      parameters (XPM_DEVICE_HF_MODEL=width:layers, default 1024:10), under the real
#      transformers.Trainer and a cap that binds (XPM_DEVICE_HF_RUNS=outer:cap_bytes, default
#      256:8000000000), planned by reserved bytes, with PyTorch's default segments and with
#      expandable_segments:True (XPM_DEVICE_ALLOC_CONFS, space-separated, "-" for the default)
# Budget: about 7 minutes of device time; XPM_DEVICE_STEPS (default 40) sets the steps per run.
# Rehearsal on a machine without a GPU: XPM_DEVICE_KIND=cpu runs the same stages with
# --device cpu (no nvidia-smi, no CUDA LibTorch required; the CUDA meter's tests skip
# themselves), e.g. XPM_DEVICE_KIND=cpu XPM_DEVICE_STEPS=8 XPM_DEVICE_HF_MODEL=64:2
# XPM_DEVICE_HF_RUNS=256:400000000 tools/device-check.sh.
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
steps=${XPM_DEVICE_STEPS:-40}
kind=${XPM_DEVICE_KIND:-cuda}
case "$kind" in
  cuda|cpu) ;;
  *) echo "device-check.sh: error: XPM_DEVICE_KIND must be cuda or cpu, got '$kind'" >&2; exit 2 ;;
esac
prefix=/tmp/xpm-prefix
build=/tmp/xpm-build-cuda
start_s=$(date +%s)
failed=0  # stages 3 to 5 go on after an error; the exit code says there was one

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
# glog's CMake config finds its FindUnwind module at the path Debian installs it to, fixed in
# the file: put it there (the GPU image has no glog) unless the machine has it.
if [ ! -e /usr/share/glog/cmake/FindUnwind.cmake ]; then
  mkdir -p /usr/share/glog && cp -r "$prefix/usr/share/glog/cmake" /usr/share/glog/ ||
    fail "cannot copy glog's CMake modules to /usr/share/glog/cmake (run as root on the GPU machine)"
fi
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
cmake --build "$build" -j "$(nproc)" --target planner_torch_tests xpm_trainer xpm-plan xpm-plan-probe \
  xpm_python_planner xpm_python_torch >>"$log_file" 2>&1 || { tail -40 "$log_file"; fail "build failed"; }
install=/tmp/xpm-install
cmake --install "$build" --prefix "$install" >>"$log_file" 2>&1 || fail "cmake --install failed (see the log)"

stage "3. CUDA tests (on the CPU: the CUDA meter's skip themselves)"
"$build/bin/planner_torch_tests" --test-case="*CUDA meter*" 2>&1 | tee -a "$log_file" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "error: the CUDA meter's tests failed"; failed=1; }
say "the allocation sequences against the $kind's caching allocator (on the CPU: the meter's emulation)"
PYTHONPATH="$build/python" "$python" tools/replay_allocation_sequences.py --device "$kind" \
  --json "$OUT/allocation-sequences-$kind.json" 2>&1 | tee -a "$log_file"
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "error: the allocation sequences did not replay"; failed=1; }

stage "4. a C++ model on the $kind: conv-genre-classifier against the installed xpm, $steps steps"
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
cmake -S examples/conv_genre_classifier -B /tmp/xpm-conv -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$install;$torch_prefix;$prefix/usr;$multiarch/cmake" >>"$log_file" 2>&1 &&
  cmake --build /tmp/xpm-conv -j "$(nproc)" >>"$log_file" 2>&1 || { tail -30 "$log_file"; fail "the example did not build"; }
/tmp/xpm-conv/conv-genre-classifier --data-dir .device/brown --run-dir /tmp/xpm-conv-run --steps "$steps" \
  --device "$kind" --memory-cap-bytes "${XPM_DEVICE_CONV_CAP_BYTES:-2000000000}" 2>&1 | tee -a "$log_file" | tail -6
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "error: conv-genre-classifier failed"; failed=1; }

stage "5. a Python model on the $kind: the HF Trainer example, $steps steps"
model=${XPM_DEVICE_HF_MODEL:-1024:10}
for conf in ${XPM_DEVICE_ALLOC_CONFS:-- expandable_segments:True}; do
  for outer_cap in ${XPM_DEVICE_HF_RUNS:-256:8000000000}; do
    say "outer batch ${outer_cap%%:*} sentences (4 accumulation steps), memory cap ${outer_cap##*:} bytes," \
        "PYTORCH_ALLOC_CONF=${conf#-}"
    rm -rf /tmp/xpm-hf  # a fresh memory model: no cache from the other allocator setting
    PYTORCH_ALLOC_CONF="${conf#-}" PYTHONPATH="$build/python" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 "$python" \
      examples/hf_trainer_causal_lm/train.py --data-dir .device/brown --steps "$steps" --device "$kind" \
      --output-dir /tmp/xpm-hf --per-device-batch-size "$(( ${outer_cap%%:*} / 4 ))" \
      --memory-cap-bytes "${outer_cap##*:}" --width "${model%%:*}" --layers "${model##*:}" 2>&1 |
      grep -v "^{" | tee -a "$log_file" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || { say "error: the HF Trainer example failed"; failed=1; }
  done
done
say "done in $(( $(date +%s) - start_s )) s"
exit "$failed"
