#!/usr/bin/env bash
# Sets up everything gossipgrad needs on this machine, idempotently:
#   a virtual environment (.venv, or $GOSSIPGRAD_VENV), torch, the project (editable) with
#   its test extras, the built-in data sets, and -- with --test -- the system packages the
#   test suite drives (Prometheus, iproute2, nftables, OpenSSH's server and client).
#
# torch: a GPU site keeps whatever torch is already importable in the venv. With none, a
# machine without an NVIDIA GPU gets $GOSSIPGRAD_TORCH (default torch==2.13.0, the CPU wheel
# on our build machines); a machine with one gets the registry's default (CUDA) build.
#
# --hivemind: also create .venv-hivemind for the experiment runner's hivemind baseline
# (hivemind pins its own protobuf and p2p daemon): the same Python, torch as above, then
# hivemind==$GOSSIPGRAD_HIVEMIND (default 1.1.12), then gossipgrad (editable) with its tasks.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
want_hivemind=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --hivemind) want_hivemind=1 ;;
    -h|--help) echo 'usage: scripts/setup.sh [--test] [--hivemind]'; sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (valid: --test, --hivemind)" >&2; exit 2 ;;
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

# torch into the venv of interpreter $1 unless it has one: the registry's default (CUDA) build
# where an NVIDIA GPU is present, else $GOSSIPGRAD_TORCH (the CPU wheel).
install_torch() {
  "$1" -c "import torch" 2>/dev/null && return 0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "installing torch into $1 (GPU present: registry default build)"
    "$1" -m pip install -q torch
  else
    spec=${GOSSIPGRAD_TORCH:-torch==2.13.0}
    log "installing $spec into $1 (no GPU found: CPU build)"
    "$1" -m pip install -q "$spec"
  fi
}
install_torch "$venv/bin/python"

# compression/kernels.c builds where a C compiler is (the install goes on without one, at
# numpy's speed); the test suite checks that it was built, so --test brings one as root.
if [ "$want_test" = 1 ] && ! command -v cc >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  log "installing a C compiler (gcc) for compression/kernels.c"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null
fi

stamp="$venv/.gossipgrad-installed"
# Again when the build changes: pyproject.toml, or setup.py and the C kernels it compiles.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
  || [ compression/kernels.c -nt "$stamp" ]; then
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
  # Sites behind NAT in network namespaces (tests/peer/runtime/test_relay_nat.py).
  command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing+=(nftables)
  # ssh mode's end-to-end test starts a throwaway sshd on 127.0.0.1.
  [ -x /usr/sbin/sshd ] || command -v sshd >/dev/null 2>&1 || missing+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      log "installing system packages: ${missing[*]}"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      log "not root: tests needing ${missing[*]} will be skipped"
    fi
  fi
fi
if [ "$want_hivemind" = 1 ]; then
  hm=.venv-hivemind
  if [ ! -x "$hm/bin/python" ]; then
    # The interpreter the main venv was made from, so both run the same Python.
    base=$("$venv/bin/python" -c "import sys; print(sys._base_executable)")
    log "creating $hm with $base"
    "$base" -m venv "$hm"
    "$hm/bin/python" -m pip install -q --upgrade pip
  fi
  hpip=("$hm/bin/python" -m pip install -q)
  # torch first, so that hivemind's own torch requirement never pulls another build.
  install_torch "$hm/bin/python"
  if ! "$hm/bin/python" -c "import hivemind" 2>/dev/null; then
    log "installing hivemind into $hm"
    "${hpip[@]}" "hivemind==${GOSSIPGRAD_HIVEMIND:-1.1.12}"
  fi
  hstamp="$hm/.gossipgrad-installed"
  if [ ! -f "$hstamp" ] || [ pyproject.toml -nt "$hstamp" ]; then
    log "installing gossipgrad (editable) into $hm"
    "${hpip[@]}" -e ".[tasks]"
    touch "$hstamp"
  fi
  "$hm/bin/python" -c "import hivemind, gossipgrad.peer.tasks; print('hivemind', hivemind.__version__)"
fi
log "ready: $venv"
