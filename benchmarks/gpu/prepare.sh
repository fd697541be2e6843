#!/usr/bin/env bash
# Here, with network access to PyPI: a folder of wheels for a GPU machine without network that has
# Python 3.12 (x86-64, manylinux), torch, accelerate, transformers, peft, safetensors and xxhash but
# not the rest of what linnaeus-accel and DeepSpeed need. benchmarks/gpu/run.sh installs them there.
#
#   bash benchmarks/gpu/prepare.sh [DIR]        # default DIR: .whl at the repository root
#
# Needs python3 with pip, and torch in the Python that builds DeepSpeed (its setup.py imports torch):
# the repository's .venv if there is one. What each wheel is for: benchmarks/gpu/WHEELS.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.whl}
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# Exact versions, so that the folder holds one of each (two would stop `pip install --no-deps *.whl`)
# and pydantic gets the pydantic-core it pins.
binary=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0  # pydantic-core 2.50 needs >= 4.16; the machine's may be older
  torchdata==0.11.0 tenacity==9.2.1
  hjson==3.1.0  # DeepSpeed's config parser; its other requirements are on the machine
)
deepspeed=deepspeed==0.19.8

rm -rf "$dir"
mkdir -p "$dir"
echo "linnaeus-accel's own wheel"
"$python" -m pip wheel -q --no-deps -w "$dir" .
echo "binary wheels for CPython 3.12, manylinux x86-64: ${binary[*]}"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${binary[@]}"
# DeepSpeed publishes only a source archive. Built here with no op compiled (DS_BUILD_OPS=0): a
# pure-Python wheel (py3-none-any) whose CUDA ops are compiled on first use there, if ever (a
# torch optimizer under ZeRO needs none). DS_ACCELERATOR=cuda records the machine's accelerator,
# not this one's CPU.
echo "$deepspeed, built without its ops"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$python" -m pip download -q --no-deps --no-binary=:all: -d "$build" "$deepspeed"
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$build"/deepspeed-*.tar.gz
if ! compgen -G "$dir/deepspeed-*-py3-none-any.whl" >/dev/null; then
  echo "error: DeepSpeed's wheel is not pure Python (py3-none-any): $(ls "$dir"/deepspeed-*)" >&2
  exit 1
fi

echo
ls -l "$dir"
du -sh "$dir"
cat <<EOF

On the GPU machine, from the repository root (benchmarks/gpu/run.sh does this itself):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/linnaeus-gpu-site $dir/*.whl
  export PYTHONPATH=/tmp/linnaeus-gpu-site
EOF
