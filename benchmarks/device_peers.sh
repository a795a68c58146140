#!/usr/bin/env bash
# benchmarks/bench_peers.py on a lent GPU machine: s4weights against torch.save, DCP (save,
# async_save, + ZStandard), s3torchconnector, ZipNN, zstd and nvCOMP ANS, bf16 and fp32 variants,
# local disk and SeaweedFS S3 on 127.0.0.1 -- one process, one table.
#
# Usage: bash benchmarks/device_peers.sh DIR [extra bench_peers.py args...]
#   DIR: carried wheels (*.whl: installed with --no-deps into /tmp/site) and optionally weed.xz
#        (SeaweedFS's `weed` binary, xz-compressed; without it the S3 peers are n/a unless `weed`
#        is on PATH or S4W_WEED names it) and libnvcomp.so.5.xz (nvCOMP 5's library from
#        nvidia-libnvcomp-cu13 5.x, for the cuZipNN peer, which binds nvCOMP 5's C API).
#   Wheels the peers need beyond torch/triton/nvCOMP: s3torchconnector + s3torchconnectorclient,
#   tenacity (s3torchconnector.dcp), zipnn, cuzipnn, zstandard, boto3 + botocore + s3transfer + jmespath
#   (the SeaweedFS helper), psutil (optional: host RSS; /proc is read without it), xxhash.
# Knobs (environment): MODEL (medium: 303 M params, 1.8 GB bf16 / 3.6 GB fp32 state), STEPS (300),
#   SAVES (3), REPEATS (3), BUDGET_S (380: peers still queued after it are reported n/a; the run is
#   sent SIGTERM at BUDGET_S+140 s and then prints the partial table),
#   VARIANTS (bf16,fp32), PEERS (all), BENCH_DIR (where checkpoints and the S3 data go: /tmp).
# Output: $OUT/peers.json (everything), $OUT/peers.md (table + targets), $OUT/peers.log (progress
#   and per-phase seconds), $OUT/env.txt. The table is also the last thing printed.
set -u
DIR=${1:?usage: device_peers.sh WHEELDIR [bench_peers args...]}; shift
. "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
phase() { echo "[device_peers] $1: $(( $(date +%s) - t0 ))s since start"; }

device_wheels "$DIR"
device_paths
if [ -f "$DIR/weed.xz" ]; then
  xz -dc "$DIR/weed.xz" > /tmp/weed && chmod +x /tmp/weed && export S4W_WEED=/tmp/weed
fi
if [ -z "${S4W_WEED:-}" ] && command -v weed >/dev/null 2>&1; then export S4W_WEED=$(command -v weed); fi
if [ -f "$DIR/libnvcomp.so.5.xz" ]; then  # nvCOMP 5 for the cuZipNN peer (bench_peers._import_cuzipnn)
  xz -dc "$DIR/libnvcomp.so.5.xz" > /tmp/libnvcomp.so.5 && export S4W_PEER_NVCOMP5=/tmp/libnvcomp.so.5
fi
phase "install"

{ device_env s3torchconnector zipnn zstandard boto3 tenacity psutil
  echo "weed: ${S4W_WEED:-none} $([ -n "${S4W_WEED:-}" ] && "$S4W_WEED" version 2>&1 | head -1)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
phase "env"

BUDGET_S=${BUDGET_S:-380}
timeout -k 15 $(( BUDGET_S + 140 )) python3 benchmarks/bench_peers.py \
  --model "${MODEL:-medium}" --steps "${STEPS:-300}" --saves "${SAVES:-3}" --repeats "${REPEATS:-3}" \
  --variants "${VARIANTS:-bf16,fp32}" --peers "${PEERS:-all}" --budget-s "$BUDGET_S" \
  --dir "${BENCH_DIR:-/tmp}" --out "$OUT/peers.json" --table-out "$OUT/peers.md" "$@" \
  > "$OUT/peers.stdout" 2> "$OUT/peers.log"
rc=$?
phase "bench_peers (rc=$rc)"
grep -E "^\[(bf16|fp32)\]|^!!!!!|^bench_peers" "$OUT/peers.log" | tail -60
echo
cat "$OUT/peers.stdout"
exit $rc
