#!/usr/bin/env bash
# One device call: kernel sweep (bench_kernels.py), @gpu parity tests, codec throughput on 1 GB.
# Usage: bash benchmarks/device_kernels.sh SITE_TAR_XZ   (results under $OUT)
set -u
SITE=${1:?usage: device_kernels.sh SITE_TAR_XZ}
. "$(dirname "$0")/device_env.sh"
device_site "$SITE"
device_paths
device_env > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout ${KTIME:-200} python3 benchmarks/bench_kernels.py --gb 1 --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | grep -v "^ " | tail -40
timeout ${PTIME:-240} python3 -m pytest -q -p no:cacheprovider tests/parity -m gpu -k "not interpreted" -x -rs > "$OUT/parity_gpu.log" 2>&1
echo "parity rc=$?"; tail -4 "$OUT/parity_gpu.log"
timeout ${CTIME:-150} python3 benchmarks/bench_codec.py --weights synthetic:1000:200 --gpu --no-e2e --repeats 10 \
  --label "synthetic N(0,0.02), 1 GB in 200 tensors" --out "$OUT/codec_1GB.json" > "$OUT/codec.log" 2>&1
echo "codec rc=$?"; grep -E "GBps|stages|ratio" "$OUT/codec.log" | cut -c1-400 | tail -12
