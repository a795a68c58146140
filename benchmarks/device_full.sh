#!/usr/bin/env bash
# One call on a 2-GPU device (kind nvidia-h200-x2) that runs every GPU check and the chain benchmark:
#   GPU 1: benchmarks/bench_chain.py (real GPT training on real text, a save every 10 steps)
#   GPU 0: tests/parity (@gpu), `s4w selftest`, the Lightning end-to-end GPU test
#   both : the DCP NCCL test (2 processes), after the benchmark finished
# Usage: bash benchmarks/device_full.sh WHEELDIR   (logs and JSON under $OUT)
set -u
WHL=$1; OUT=${OUT:-./device_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
  || { echo "wheel install failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/integrations PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; from nvidia import nvcomp; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'nvcomp', getattr(nvcomp, '__version__', '?'))"
  echo "git HEAD $(git rev-parse HEAD 2>/dev/null) (the device's .git may lag the tree it was sent)"
  echo "source digest $(bash benchmarks/tree_digest.sh) (benchmarks/tree_digest.sh REV gives a commit's)"; } > "$OUT/env.txt" 2>&1
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
