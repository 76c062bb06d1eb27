#!/usr/bin/env bash
# The CUDA parts compile and link against a CUDA build of torch (pip's wheel) and the CUDA
# toolkit (CUDA_HOME, else /usr/local/cuda), without a GPU: xpm::planner_torch with the real
# CudaMemoryMeter (the caching allocator's statistics) and xpm::trainer with the NCCL process
# group, each shared library linked with --no-undefined, so every symbol they use must resolve
# in torch's CUDA libraries. A GPU machine then never meets a compile error first.
#
# Usage: tests/cuda/cuda_build_check.sh PYTHON_WITH_CUDA_TORCH SOURCE_DIR BUILD_DIR
#   BUILD_DIR (about 700 MB) is removed once the check passes; BUILD_DIR.log stays.
set -euo pipefail
python=$1 source=$2 build=$3

if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  echo "cuda_build_check: $python has no CUDA build of torch (tools/setup.sh --test makes .venv-cuda)" >&2
  exit 1
fi
echo "torch $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
log=$build.log
if ! cmake -S "$source" -B "$build" -DCMAKE_BUILD_TYPE=Release -DXPM_PYTHON_EXECUTABLE="$python" \
     -DXPM_BUILD_TESTS=OFF -DXPM_BUILD_BENCHMARKS=OFF -DXPM_BUILD_PYTHON=OFF \
     -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--no-undefined >"$log" 2>&1; then
  tail -30 "$log" >&2
  echo "cuda_build_check: configure failed" >&2
  exit 1
fi
grep "xpm: CUDA LibTorch" "$log" || { echo "cuda_build_check: CMake did not take the CUDA parts" >&2; exit 1; }
if ! cmake --build "$build" -j 1 --target xpm_planner_torch xpm_trainer >>"$log" 2>&1; then
  grep -E "error|undefined reference" "$log" | head -30 >&2
  echo "cuda_build_check: build failed" >&2
  exit 1
fi
if grep -q "warning:" "$log"; then
  grep "warning:" "$log" | sort -u | head -10 >&2
  echo "cuda_build_check: the CUDA parts build with warnings" >&2
  exit 1
fi
# The real meter and the NCCL group are in the libraries, not the stand-ins of a CPU build.
# (nm's output is kept first: grep -q would stop reading early and, under pipefail, fail nm.)
planner_torch_symbols=$(nm -DC "$build/lib/libxpm_planner_torch.so")
grep -q "CUDACachingAllocator" <<<"$planner_torch_symbols" ||
  { echo "cuda_build_check: libxpm_planner_torch.so does not use the CUDA caching allocator" >&2; exit 1; }
trainer_symbols=$(nm -DC "$build/lib/libxpm_trainer.so")
grep -q "ProcessGroupNCCL" <<<"$trainer_symbols" ||
  { echo "cuda_build_check: libxpm_trainer.so does not use the NCCL process group" >&2; exit 1; }
echo "cuda_build_check: CudaMemoryMeter and the NCCL process group compiled and linked (no undefined symbols)"
rm -rf "$build"
