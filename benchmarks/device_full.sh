#!/usr/bin/env bash
# One call on a 2-GPU device (kind nvidia-h200-x2) that runs every GPU check and the chain benchmark:
#   GPU 1: benchmarks/bench_chain.py (real GPT training on real text, a save every 10 steps)
#   GPU 0: tests/parity (@gpu), `s4w selftest`, the Lightning end-to-end GPU test
#   both : the DCP NCCL test (2 processes), after the benchmark finished
# Usage: bash benchmarks/device_full.sh WHEELDIR   (logs and JSON under $OUT)
set -u
WHL=${1:?usage: device_full.sh WHEELDIR}
. "$(dirname "$0")/device_env.sh"
device_wheels "$WHL" required
device_paths
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
device_env > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
CUDA_VISIBLE_DEVICES=1 timeout ${BENCH_TIMEOUT:-470} python3 benchmarks/bench_chain.py --device cuda --profile fast \
  --layers 12 --d 768 --ctx 512 --batch 16 --steps ${BENCH_STEPS:-200} --every 10 --compare chain_xor,plain \
  --out "$OUT/chain_gpu.json" > "$OUT/chain_gpu.log" 2>&1 &
bench=$!
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/parity -m gpu -k "not interpreted" -rs \
  > "$OUT/parity_gpu.log" 2>&1; echo "parity rc=$?" | tee -a "$OUT/parity_gpu.log"; tail -3 "$OUT/parity_gpu.log"
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m s4w_core.cli selftest > "$OUT/selftest_gpu.txt" 2>&1; echo "selftest rc=$?" | tee -a "$OUT/selftest_gpu.txt"; tail -3 "$OUT/selftest_gpu.txt"
CUDA_VISIBLE_DEVICES=0 S4W_GPU_RESULTS=$OUT/integ timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/integrations/test_gpu.py -k lightning -rs > "$OUT/integ_gpu.log" 2>&1; echo "lightning rc=$?" | tee -a "$OUT/integ_gpu.log"; tail -3 "$OUT/integ_gpu.log"
wait $bench; echo "bench rc=$?"; tail -25 "$OUT/chain_gpu.log"
S4W_GPU_RESULTS=$OUT/integ timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integrations/test_gpu.py -k dcp -rs \
  >> "$OUT/integ_gpu.log" 2>&1; echo "dcp rc=$?" | tee -a "$OUT/integ_gpu.log"; tail -3 "$OUT/integ_gpu.log"
