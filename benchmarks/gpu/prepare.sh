#!/usr/bin/env bash
# Here, with network access to PyPI: a folder of wheels for a GPU machine without network that has
# CPython 3.12 (x86-64, manylinux), torch, accelerate, transformers, peft, safetensors, xxhash, numpy
# and the rest of their stack, but not pydantic, torchdata, tenacity or DeepSpeed.
# benchmarks/gpu/run.sh installs them there. What each wheel is for: benchmarks/gpu/WHEELS.md.
#
#   bash benchmarks/gpu/prepare.sh [DIR]     # DIR: default .whl at the repository root; a relative
#                                            # DIR is taken from the current directory
#   PYTHON=/path/to/python bash benchmarks/gpu/prepare.sh
#
# Needs a Python with pip, setuptools and torch (DeepSpeed's setup.py imports torch; any build,
# the CPU one will do): $PYTHON, else the repository's .venv, else python3. Every wheel is made in
# a temporary folder and checked (one version of each package, tags that CPython 3.12 manylinux
# x86-64 accepts, every requirement either in the folder or on the GPU machine) before the *.whl
# of DIR are replaced; on failure DIR is left as it was. Other files in DIR are not touched.
set -Eeuo pipefail

step="starting"
trap 'echo "prepare.sh: error while $step (exit status $?)" >&2' ERR

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir_arg=${1:-$repo/.whl}
mkdir -p "$dir_arg"
dir=$(cd "$dir_arg" && pwd)
cd "$repo"

if [[ -n ${PYTHON:-} ]]; then
  python=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  python=$repo/.venv/bin/python
else
  python=python3
fi
step="checking $python"
if ! { "$python" -c 'import setuptools, torch' && "$python" -m pip --version >/dev/null; }; then
  echo "prepare.sh: $python needs pip, setuptools and torch (DeepSpeed's setup.py imports torch);" \
    "set PYTHON to a Python that has them" >&2
  exit 1
fi

# Exact versions: the folder must hold one version of each package (two stop
# `pip install --no-deps *.whl`), and pydantic pins the exact pydantic-core it was built with.
binary=(
  pydantic==2.14.4
  pydantic-core==2.50.5      # the version pydantic 2.14.4 pins
  annotated-types==0.8.0     # pydantic
  typing-inspection==0.4.5   # pydantic
  typing-extensions==4.16.0  # pydantic and pydantic-core need >= 4.16; the machine's may be older
  torchdata==0.11.0          # StatefulDataLoader
  tenacity==9.2.1            # retries of checkpoint uploads
  hjson==3.1.0               # DeepSpeed's config parser
)
deepspeed_version=0.19.8
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
  manylinux1_x86_64)

start=$SECONDS
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/wheels" "$stage/src"

step="building linnaeus-accel's own wheel"
echo "$step"
if "$python" -c 'import hatchling' 2>/dev/null; then
  "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$stage/wheels" .
else  # pip fetches hatchling from PyPI into an isolated build environment
  "$python" -m pip wheel -q --no-deps -w "$stage/wheels" .
fi

step="downloading the binary wheels for CPython 3.12, manylinux x86-64"
echo "$step: ${binary[*]}"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]/#/--platform=}" -d "$stage/wheels" "${binary[@]}"

# DeepSpeed publishes only a source archive. It is built here with none of its C++/CUDA ops
# compiled (DS_BUILD_OPS=0, also the default on Linux): a pure-Python wheel (py3-none-any) that
# carries the ops' sources, which DeepSpeed compiles with ninja on the GPU machine on first use, if
# ever. DS_ACCELERATOR=cuda: the wheel records the CUDA accelerator (this machine would record
# "cpu") and so lists nvidia-ml-py among its requirements; neither changes a file of the wheel.
step="downloading DeepSpeed $deepspeed_version's source archive"
echo "$step"
"$python" -m pip download -q --no-deps --no-binary=:all: -d "$stage/src" "deepspeed==$deepspeed_version"
step="building DeepSpeed $deepspeed_version without its ops (pure Python)"
echo "$step"
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$python" -m pip wheel -q --no-deps --no-build-isolation \
  -w "$stage/wheels" "$stage/src/deepspeed-$deepspeed_version.tar.gz" >"$stage/deepspeed-build.log" 2>&1 \
  || { cat "$stage/deepspeed-build.log" >&2; false; }

step="checking the wheels"
echo "$step"
"$python" - "$stage/wheels" "${platforms[@]}" <<'EOF'
import email.parser, pathlib, sys, zipfile
try:
    from packaging import tags
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging import tags
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

folder, platforms = pathlib.Path(sys.argv[1]), sys.argv[2:]
# What the GPU machine has installed (None: version not known); requests brings urllib3 & co.
machine = {canonicalize_name(n): v for n, v in {
    "torch": "2.11", "accelerate": "1.15", "transformers": "5.17", "numpy": "2.5", "peft": None,
    "safetensors": None, "xxhash": None, "scikit-learn": None, "pyyaml": None, "tqdm": None,
    "msgpack": None, "ninja": None, "psutil": None, "py-cpuinfo": None, "nvidia-ml-py": None,
    "einops": None, "packaging": None, "typing-extensions": None, "requests": None, "urllib3": None,
    "idna": None, "certifi": None, "charset-normalizer": None, "filelock": None, "fsspec": None,
    "huggingface-hub": None, "matplotlib": None, "tensorboard": None}.items()}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
       "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
supported = set(tags.cpython_tags((3, 12), platforms=platforms))
supported |= set(tags.compatible_tags((3, 12), "cp312", platforms))

errors, wheels = [], {}
for path in sorted(folder.glob("*.whl")):
    name, version, _, wheel_tags = parse_wheel_filename(path.name)
    if name in wheels:
        errors.append(f"two versions of {name}: {wheels[name][1]} and {version}")
    if not wheel_tags & supported:
        errors.append(f"{path.name}: not installable on CPython 3.12 manylinux x86-64")
    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
        if name == "deepspeed":
            compiled = [n for n in z.namelist() if n.endswith((".so", ".pyd"))]
            if compiled or "py3-none-any" not in path.name:
                errors.append(f"{path.name} is not pure Python: {compiled[:5]}")
    wheels[name] = (path, version, meta.get_all("Requires-Dist") or [])

for name, (path, _, requires) in wheels.items():
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra, or another platform
        dep = canonicalize_name(req.name)
        have = str(wheels[dep][1]) if dep in wheels else machine.get(dep, "missing")
        if have == "missing":
            errors.append(f"{name} requires {req}: neither in the folder nor on the GPU machine")
        elif have is not None and not req.specifier.contains(Version(have), prereleases=True):
            errors.append(f"{name} requires {req}, but {dep} is {have}")

total = 0
for name, (path, _, _) in sorted(wheels.items()):
    size = path.stat().st_size
    total += size
    print(f"  {size / 1024:8.0f} KiB  {path.name}")
print(f"  {total / 2**20:8.1f} MiB  in all, {len(wheels)} wheels")
if total >= 40 * 2**20:
    errors.append(f"{total / 2**20:.1f} MiB in all: over the 40 MiB limit")
for e in errors:
    print(f"error: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
EOF

step="replacing the wheels of $dir"
shopt -s nullglob
old=("$dir"/*.whl)
rm -f -- "${old[@]}"
mv -- "$stage"/wheels/*.whl "$dir"/
trap - ERR

case $dir in
  "$repo"/*) shown=${dir#"$repo"/} ;;
  *) shown=$dir ;;
esac
new=("$dir"/*.whl)
echo
echo "$shown: ${#new[@]} wheels, made in $((SECONDS - start)) s." \
  "On the GPU machine, from the repository root (benchmarks/gpu/run.sh does the same into" \
  "/tmp/linnaeus-gpu-site):"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade" \
  "--target /tmp/linnaeus-gpu-site $shown/*.whl && export PYTHONPATH=/tmp/linnaeus-gpu-site"
