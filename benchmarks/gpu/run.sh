#!/usr/bin/env bash
# The GPU check on a machine with a GPU, from any directory:
#   bash benchmarks/gpu/run.sh OUT_DIR [--only PART ...] [--budget-s SECONDS]
# Installs the wheels benchmarks/gpu/prepare.sh put in .whl/ (if any) into a separate directory on
# PYTHONPATH, never over the machine's torch; then runs every part (python -m benchmarks.gpu) and
# writes OUT_DIR/results.json, OUT_DIR/log.txt, OUT_DIR/<part>.log and OUT_DIR/run_logs.tar.gz. Run
# directories and checkpoints (GBs) go to $TMPDIR/linnaeus-gpu-work, not OUT_DIR.
set -euo pipefail
out=${1:?usage: bash benchmarks/gpu/run.sh OUT_DIR [--only PART ...] [--budget-s SECONDS]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
wheels=${LINNAEUS_GPU_WHEELS:-.whl}  # prepare.sh's folder (its wheels are for Python 3.12)
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=${LINNAEUS_GPU_SITE:-/tmp/linnaeus-gpu-site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 -m benchmarks.gpu "$out" "$@"
