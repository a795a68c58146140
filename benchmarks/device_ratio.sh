#!/usr/bin/env bash
# benchmarks/bench_ratio.py --series gpt --gpu on a lent GPU machine: a GPT-2-shaped byte-level model
# (25.6 M parameters) trained there from scratch in bf16 and in fp32 (nothing is downloaded), and the
# ratio table per tensor group (weights, exp_avg, exp_avg_sq; plain and chain) with s4weights'
# CPU-written (portable) and GPU-written (fast) files beside z4ai and ZipNN, every file and frame
# decoded and compared -- one call, about 4 minutes on an H100 with 16 cores.
#
# Usage: bash benchmarks/device_ratio.sh WHEELDIR [bench_ratio.py args...]
#   WHEELDIR: carried wheels (*.whl, installed with --no-deps into /tmp/site): nvidia-nvcomp-cu13 and
#             nvidia-libnvcomp-cu13 (the GPU codec) and zstandard (z4ai's); and the peers' source
#             distributions z4ai-*.tar.gz and zipnn-*.tar.gz (the registry has no wheels of them),
#             built there with the image's setuptools, C compiler and Python headers. A peer that does
#             not build is left out of the table; its build log says why.
#   Knobs (environment): BUDGET_S (360: the benchmark is stopped after it), CACHE (/tmp/s4w_ratio_series:
#   the trained snapshots and the peers' sizes), GPU (1; 0 leaves out the GPU-written files, for a dry
#   run on a machine without a GPU). The set-up (/tmp/site, PYTHONPATH, env.txt) is device_env.sh's.
# Output: $OUT/ratio_gpt_gpu.md (the table), $OUT/ratio_gpt_gpu.json (everything), $OUT/ratio_gpt_gpu.log
#   (progress), $OUT/env.txt, $OUT/build_z4ai.log, $OUT/build_zipnn.log; the table is printed last.
set -u
DIR=${1:?usage: device_ratio.sh WHEELDIR [bench_ratio.py args...]}; shift
. "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
device_wheels "$DIR"
for src in "$DIR"/z4ai-*.tar.gz "$DIR"/zipnn-*.tar.gz; do
  [ -f "$src" ] || continue
  name=$(basename "$src"); name=${name%%-*}
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site \
    "$src" > "$OUT/build_$name.log" 2>&1
  echo "$name build rc=$?" | tee -a "$OUT/build_$name.log"
done
echo "install: $(( $(date +%s) - t0 )) s"
device_paths
{ device_env z4ai zipnn zstandard
  # builds z4ai's native rANS (z4ai compiles it on first use) before the worker processes race to
  python3 -c "import z4ai.rans, z4ai.rans_o1; print('z4ai native rANS', z4ai.rans.available(), 'order-1', z4ai.rans_o1.available())" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
BUDGET_S=${BUDGET_S:-360}
CACHE=${CACHE:-/tmp/s4w_ratio_series}
rm -f "$OUT"/ratio_gpt_gpu.md "$OUT"/ratio_gpt_gpu.json
GPU_ARG=--gpu; [ "${GPU:-1}" = 0 ] && GPU_ARG=
timeout -k 10 "$BUDGET_S" python3 benchmarks/bench_ratio.py --series gpt $GPU_ARG --cache "$CACHE" --out "$OUT/ratio_gpt_gpu" "$@" \
  > "$OUT/ratio_gpt_gpu.log" 2>&1
rc=$?
echo "bench_ratio rc=$rc after $(( $(date +%s) - t0 )) s"
grep -v "^|" "$OUT/ratio_gpt_gpu.log" | tail -40
if [ -f "$OUT/ratio_gpt_gpu.md" ]; then cat "$OUT/ratio_gpt_gpu.md"; fi
exit $rc
