#!/usr/bin/env bash
# The HF Trainer integration against the newest transformers release as well as the pinned one:
# PlannedTrainerMixin relies on private Trainer methods (docs/integrations/hf-trainer.md), which transformers may
# change in any release. A fresh virtual environment sees the installed xpm and the project's
# packages (torch, accelerate, trl, ...) through a .pth file, and holds the release named in
# python/requirements-newest-transformers.txt itself; test_hf_trainer.py and test_hf_dropin.py then run there.
#
# Usage: tests/python/newest_transformers_test.sh INSTALLED_XPM_PYTHON PROJECT_PYTHON NEW_VENV_DIR
set -euo pipefail
installed=$1 project=$2 venv=$3
tests=$(cd "$(dirname "$0")" && pwd)
requirements=$tests/../../python/requirements-newest-transformers.txt
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$requirements" "$venv/requirements.txt"; then
  rm -rf "$venv"
  "$project" -m venv "$venv"
  { purelib "$installed"; purelib "$project"; } > "$(purelib "$venv/bin/python")/xpm-test-environments.pth"
  if ! output=$("$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" 2>&1); then
    echo "$output" >&2
    echo "newest_transformers_test.sh: pip install -r $requirements failed" >&2
    exit 1
  fi
  cp "$requirements" "$venv/requirements.txt"
fi
"$venv/bin/python" - "$requirements" <<'PY'
import re, sys
import transformers, xpm
pinned = re.search(r"^transformers==(\S+)", open(sys.argv[1]).read(), re.M).group(1)
assert transformers.__version__ == pinned, f"transformers {transformers.__version__} imported, {pinned} pinned"
print(f"transformers {transformers.__version__} (the newest release pinned), xpm {xpm.__version__} from {xpm.__file__}")
PY
cd "$tests"
# The drop-in's DDP run (2 ranks, 80 s) is left to the pinned release's run: it adds no private
# Trainer method to what the one-process tests use.
"$venv/bin/python" -m pytest -q -p no:cacheprovider integrations/test_hf_trainer.py integrations/test_hf_dropin.py \
  -k "not two_ddp_ranks"
