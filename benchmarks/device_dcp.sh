#!/usr/bin/env bash
# benchmarks/dcp_fsdp.py on a lent 2-GPU machine: FSDP2 over NCCL, a bf16 GPT (805 M parameters by
# default), dcp.async_save every 10 steps with DCP's FileSystemWriter and with s4weights'
# S4StorageWriter(root, step=N); loads, resharding load 2->1 and bit-exact resume.
#
# Usage: bash benchmarks/device_dcp.sh WHEELDIR [dcp_fsdp.py args...]
#   WHEELDIR: carried wheels (*.whl, e.g. nvidia-nvcomp-cu13 and nvidia-libnvcomp-cu13), installed
#             with --no-deps into /tmp/site.
#   Knobs (environment): NPROC (2), BUDGET_S (420: writers not started by then are skipped), WORK
#   (/tmp/s4w_dcp_fsdp: where the runs write).
# Output: $OUT/dcp_fsdp.{json,md}, $OUT/dcp_fsdp.log, $OUT/env.txt; the table is printed last.
set -u
DIR=${1:?usage: device_dcp.sh WHEELDIR [args...]}; shift 1
. "$(dirname "$0")/device_env.sh"
device_wheels "$DIR"
device_paths
device_env > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
BUDGET_S=${BUDGET_S:-420}
WORK=${WORK:-/tmp/s4w_dcp_fsdp}; rm -rf "$WORK"; mkdir -p "$WORK"
timeout -k 10 $(( BUDGET_S + 150 )) python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" benchmarks/dcp_fsdp.py \
  --out "$OUT" --work "$WORK" --budget-s "$BUDGET_S" "$@" > "$OUT/dcp_fsdp.log" 2>&1
rc=$?
rm -rf "$WORK"
grep -v "UserWarning\|return func" "$OUT/dcp_fsdp.log" | tail -30
exit $rc
