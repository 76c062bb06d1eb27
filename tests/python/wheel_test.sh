#!/usr/bin/env bash
# The wheel as a user without a compiler or the Debian libraries gets it: tools/make_wheel.sh
# builds it; then, in a mount namespace where the C and C++ compilers and every system copy of a
# library the wheel bundles read as empty files (/dev/null bind mounts, so neither runs nor
# loads), pip installs it into a fresh virtual environment that sees only torch and numpy (the
# project environment's, through a .pth file), xpm probes and plans a PyTorch step, `xpm-plan
# fit` fits a CSV, and the planner and sampler suites run.
#
# Usage: tests/python/wheel_test.sh PYTHON_WITH_TORCH WORK_DIR PIP_BUILD_DIR
# Needs root (unshare -m, mount); exit code 77 (CTest: skipped) without it.
set -euo pipefail
python=$1 work=$2 build_dir=$3
tests=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$tests/../.." && pwd)
if [ "$(id -u)" -ne 0 ] || ! unshare -m true 2>/dev/null; then
  echo "wheel_test.sh: skipped: hiding the system libraries needs root (unshare -m, mount --bind)"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
"$root/tools/make_wheel.sh" "$python" "$work/dist" "$build_dir"
wheel=$(ls "$work"/dist/xpm-*.whl)
venv=$work/venv
"$python" -m venv "$venv"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib "$python" > "$(purelib "$venv/bin/python")/xpm-project-environment.pth"

# The system files of the libraries the wheel carries in xpm.libs/ (name before the hash), and
# the compilers.
"$venv/bin/python" - "$wheel" > "$work/hidden.txt" <<'PY'
import glob, os, re, sys, zipfile
names = {re.sub(r"-[0-9a-f]{8}(?=\.)", "", os.path.basename(n)) for n in zipfile.ZipFile(sys.argv[1]).namelist()
         if n.startswith("xpm.libs/")}
stems = {name.split(".so")[0] for name in names}
hidden = set()
for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/usr/lib"):
    for path in glob.glob(f"{folder}/*.so*") + glob.glob(f"{folder}/*/*.so*"):
        if os.path.basename(path).split(".so")[0] in stems and os.path.isfile(path):
            hidden.add(os.path.realpath(path))
print("\n".join(sorted(hidden)))
PY
for compiler in cc c++ gcc g++ cpp; do
  if command -v "$compiler" >/dev/null; then realpath "$(command -v "$compiler")"; fi
done | sort -u >> "$work/hidden.txt"
echo "hiding $(wc -l < "$work/hidden.txt") system files (the libraries, the compilers): $(xargs -n1 basename < "$work/hidden.txt" | tr '\n' ' ')"

csv=$work/measured.csv
printf 'bs,l,peak_bytes\n1,8,1064\n2,8,1128\n4,16,1512\n8,32,3048\n2,32,1512\n' > "$csv"
cp "$tests/test_planning.py" "$tests/test_sampler.py" "$tests/conftest.py" "$tests/installed_copy_check.py" "$work/"
unshare -m --propagation private bash -euo pipefail -s "$venv/bin/python" "$work" "$wheel" <<'INNER'
python=$1 work=$2 wheel=$3
while read -r path; do mount --bind /dev/null "$path"; done < "$work/hidden.txt"
# The hiding holds: the system's copy of the first hidden library cannot be loaded, and no
# compiler runs.
first=$(head -1 "$work/hidden.txt")
if "$python" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$first" 2>/dev/null; then
  echo "wheel_test.sh: $first still loads: the libraries are not hidden" >&2
  exit 1
fi
if g++ --version >/dev/null 2>&1 || gcc --version >/dev/null 2>&1; then
  echo "wheel_test.sh: a compiler still runs: it is not hidden" >&2
  exit 1
fi
start=$(date +%s.%N)
"$python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
echo "installed $(basename "$wheel") without a compiler in $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $start}") s"
"$python" "$work/installed_copy_check.py" "from the wheel"
"$work/venv/bin/xpm-plan" fit "$work/measured.csv" --formula 'a*bs*l + c' --variables bs,l \
  --bytes-column peak_bytes --output "$work/model.json" | tail -1
"$work/venv/bin/xpm-plan" predict --model "$work/model.json" --dims bs=4,l=16
cd "$work"
XPM_BIN_DIR="$work/venv/bin" "$python" -m pytest -q -p no:cacheprovider test_planning.py test_sampler.py 2>&1 | tail -2
INNER
