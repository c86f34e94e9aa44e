#!/usr/bin/env bash
# Sets up everything gossipgrad needs on this machine, idempotently:
#   a virtual environment (.venv, or $GOSSIPGRAD_VENV), torch, the project (editable) with
#   its test extras, the built-in data sets, and -- with --test -- the system packages the
#   test suite drives (Prometheus, iproute2).
#
# torch: a GPU site keeps whatever torch is already importable in the venv. With none, a
# machine without an NVIDIA GPU gets $GOSSIPGRAD_TORCH (default torch==2.13.0, the CPU wheel
# on our build machines); a machine with one gets the registry's default (CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (valid: --test)" >&2; exit 2 ;;
  esac
done

venv=${GOSSIPGRAD_VENV:-.venv}
python=${PYTHON:-python3}
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment $venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
pip=("$venv/bin/python" -m pip install -q)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "installing torch (GPU present: registry default build)"
    "${pip[@]}" torch
  else
    spec=${GOSSIPGRAD_TORCH:-torch==2.13.0}
    log "installing $spec (no GPU found: CPU build)"
    "${pip[@]}" "$spec"
  fi
fi

stamp="$venv/.gossipgrad-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing gossipgrad (editable) with test extras"
  "${pip[@]}" -e ".[test]"
  touch "$stamp"
fi

if [ -x scripts/fetch_data.sh ]; then
  bash scripts/fetch_data.sh
fi

if [ "$want_test" = 1 ]; then
  missing=()
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      log "installing system packages: ${missing[*]}"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      log "not root: tests needing ${missing[*]} will be skipped"
    fi
  fi
fi
log "ready: $venv"
