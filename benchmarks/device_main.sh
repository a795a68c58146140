#!/usr/bin/env bash
# One device call (nvidia-h200): kernel + gather sweep, codec segment sweep, and the delta-chain
# benchmark (bf16 by default). Usage: bash benchmarks/device_main.sh SITE_TAR_XZ [PKDIR]  (results under $OUT)
set -u
SITE=${1:?usage: device_main.sh SITE_TAR_XZ [PKDIR]}
. "$(dirname "$0")/device_env.sh"
device_site "$SITE"
device_paths
if [ -n "${2:-}" ] && ls "$2"/zipnn-*.tar.gz >/dev/null 2>&1; then
  (python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site "$2"/zipnn-*.tar.gz > "$OUT/zipnn_build.log" 2>&1; echo "zipnn build rc=$?" >> "$OUT/zipnn_build.log") &
fi
device_env > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
timeout 90 python3 benchmarks/bench_kernels.py --gb 1 --configs 4096x4,4096x8,8192x4 --repeats 10 --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?"; grep -E "gather|best|copy" "$OUT/kernels.log"
timeout 150 python3 benchmarks/bench_codec.py --weights synthetic:1000:200 --gpu --no-e2e --repeats 5 --segs 128,256,512 \
  --label "synthetic N(0,0.02), 1 GB in 200 tensors, fast segment sweep" --out "$OUT/codec_segs.json" > "$OUT/codec.log" 2>&1
echo "codec rc=$?"
python3 - "$OUT/codec_segs.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for g, v in d["groups"].items():
    for k, x in v.items():
        if isinstance(x, dict):
            print(g, k, {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in x.items() if "GBps" in kk or kk == "ratio" or "stages" in kk})
PY
fi
wait
tail -1 "$OUT/zipnn_build.log" 2>/dev/null
timeout ${CHAIN_TIME:-330} python3 benchmarks/bench_chain.py --device cuda --profile fast --layers 12 --d 768 --ctx 512 \
  --batch 16 --steps ${CHAIN_STEPS:-300} --every 10 --variants ${CHAIN_VARIANTS:-bf16} -K ${CHAIN_K:-10} \
  --compare ${CHAIN_COMPARE:-chain_xor,plain,zipnn} --out "$OUT/chain.json" > "$OUT/chain.log" 2>&1
echo "chain rc=$?"; grep -v "loss" "$OUT/chain.log" | tail -22 | cut -c1-260
