#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on a lent GPU machine (the `run` tool of this workplace).
# Usage: bash benchmarks/device_run.sh WHEELDIR MODE [bench args...]
#   MODE tests : nvidia-smi, pytest tests/parity (the @gpu tests)
#   MODE bench : benchmarks/bench_codec.py with the remaining arguments
# Logs go to $OUT (or ./device_out when OUT is unset).
set -u
WHL=${1:?usage: device_run.sh WHEELDIR MODE [bench args...]}; MODE=${2:?MODE: tests or bench}; shift 2
. "$(dirname "$0")/device_env.sh"
device_wheels "$WHL" required
device_paths
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if [ "$MODE" = tests ]; then
  timeout 420 python3 -m pytest --maxfail=15 -q -p no:cacheprovider tests/parity -m gpu -k "not interpreted" \
     --durations=15 -rs 2>&1 | tee "$OUT/pytest_gpu.log" | tail -60
else
  timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_codec.py "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
