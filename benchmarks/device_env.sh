# shellcheck shell=bash
# Sourced by every benchmarks/device_*.sh (not run on its own), from the repository root: what a run on a
# lent GPU machine sets up before its work. Sourcing it sets OUT (the results folder: $OUT, or
# ./device_out) and creates it; then the script calls what it needs:
#   device_wheels DIR [required]  pip-installs DIR/*.whl with --no-deps into /tmp/site; a DIR without
#                                 wheels installs nothing unless `required`; a failed install exits 3
#   device_site SITE_TAR_XZ       unpacks a prepared site-packages tarball into /tmp/site (exit 3 if not)
#   device_paths                  PYTHONPATH=/tmp/site:$PWD:$PWD/integrations (+ the inherited one),
#                                 PYTHONUNBUFFERED=1
#   device_env [DIST...]          the run's provenance, for $OUT/env.txt: date, GPUs, torch / triton / CUDA,
#                                 nvCOMP, s4weights' GPU backend, the versions of DIST..., cores, memory and
#                                 free disk, git HEAD and the source digest (benchmarks/tree_digest.sh)

OUT=${OUT:-./device_out}
mkdir -p "$OUT"

device_wheels() {
  local dir=${1:?device_wheels: WHEELDIR} required=${2:-}
  if [ -z "$required" ] && ! ls "$dir"/*.whl >/dev/null 2>&1; then
    return 0
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl \
    || { echo "wheel install failed"; exit 3; }
}

device_site() {
  mkdir -p /tmp/site
  tar xJf "${1:?device_site: SITE_TAR_XZ}" -C /tmp/site || { echo "site unpack failed"; exit 3; }
}

device_paths() {
  export PYTHONPATH=/tmp/site:$PWD:$PWD/integrations${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
}

device_env() {
  local m
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" 2>&1
  python3 -c "from nvidia import nvcomp; print('nvcomp', getattr(nvcomp, '__version__', '?'))" 2>/dev/null || echo "nvcomp MISSING"
  python3 -c "import s4w_core.gpu as g; print('s4w gpu', g.available(), g.unavailable_reason())" 2>&1
  for m in "$@"; do
    python3 -c "import importlib.metadata as md; print('$m', md.version('$m'))" 2>/dev/null || echo "$m MISSING"
  done
  echo "nproc $(nproc); $(free -g 2>/dev/null | awk '/Mem:/{print $2" GB RAM"}'); disk $(df -h "${BENCH_DIR:-/tmp}" | awk 'NR==2{print $4" free"}')"
  echo "git HEAD $(git rev-parse HEAD 2>/dev/null) (the device's .git may lag the tree it was sent)"
  echo "source digest $(bash "$(dirname "${BASH_SOURCE[0]}")/tree_digest.sh" 2>/dev/null) (benchmarks/tree_digest.sh REV gives a commit's)"
}
