#!/usr/bin/env bash
# Installs the xpm package with `pip install --no-build-isolation <source>` into a fresh virtual
# environment, as a user would, and checks that it imports and probes a PyTorch step on CPU.
# The new environment sees the dependencies of the project's environment (torch, numpy, pytest,
# scikit-build-core, pybind11 and the integrations' packages) through a .pth file instead of a
# second copy of torch; xpm itself is installed only into the new environment, so the Python
# suites that run with it test the installed copy.
#
# Usage: tests/python/install_package.sh PYTHON_WITH_TORCH SOURCE_DIR NEW_VENV_DIR [PIP_BUILD_DIR]
# PIP_BUILD_DIR: scikit-build-core's build folder, kept between installs (only what changed is
# rebuilt); without it pip builds in a temporary folder, as a user's install does.
set -euo pipefail
python=$1 source=$2 venv=$3 build_dir=${4:-}
settings=()
[ -z "$build_dir" ] || settings=("--config-settings=build-dir=$build_dir")

rm -rf "$venv"
"$python" -m venv "$venv"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib "$python" > "$(purelib "$venv/bin/python")/xpm-project-environment.pth"
if ! output=$("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
                 "${settings[@]}" "$source" 2>&1); then
  echo "$output" >&2
  echo "install_package.sh: pip install --no-build-isolation $source failed" >&2
  exit 1
fi
"$venv/bin/python" "$(dirname "$0")/installed_copy_check.py" "installed from source"
# The command line the package installs: xpm-plan fit of a CSV, and bad input refused (exit 2).
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf 'bs,l,peak_bytes\n1,8,1064\n2,8,1128\n4,16,1512\n8,32,3048\n2,32,1512\n' > "$work/measured.csv"
"$venv/bin/xpm-plan" fit "$work/measured.csv" --formula 'a*bs*l + c' --variables bs,l --bytes-column peak_bytes \
  --output "$work/model.json" > "$work/fit.txt"
grep -q "Usable" "$work/fit.txt" || { cat "$work/fit.txt"; echo "install_package.sh: xpm-plan fit: no usable fit" >&2; exit 1; }
"$venv/bin/xpm-plan" predict --model "$work/model.json" --dims bs=4,l=100 | tee "$work/predict.txt"
set +e
"$venv/bin/xpm-plan" fit "$work/measured.csv" --formula 'a*bs*l + c' --variables bs,l --bytes-column nope 2>"$work/bad.txt"
code=$?
set -e
[ "$code" -eq 2 ] || { cat "$work/bad.txt"; echo "install_package.sh: bad input exited $code, not 2" >&2; exit 1; }
version=$("$venv/bin/python" -c 'import xpm; print(xpm.__version__)')
[ "$("$venv/bin/xpm-plan" --version)" = "xpm-plan $version" ] ||
  { echo "install_package.sh: xpm-plan --version is not 'xpm-plan $version'" >&2; exit 1; }
echo "installed xpm-plan $version: fit, predict, and exit code 2 on bad input: $(head -1 "$work/bad.txt")"
