#!/usr/bin/env bash
# benchmarks/frameworks.py on a lent GPU machine: Lightning, HF Trainer, Accelerate and DCP trained
# without checkpoints, with the framework's default and with s4weights (cold and warm Triton cache),
# one precision per call so that it fits one 10-minute command.
#
# Usage: bash benchmarks/device_frameworks.sh WHEELDIR PRECISION [frameworks.py args...]
#   WHEELDIR: carried wheels (*.whl, e.g. nvidia-nvcomp-cu13 and nvidia-libnvcomp-cu13), installed
#             with --no-deps into /tmp/site; PRECISION: bf16 or fp32master.
#   Knobs (environment): BUDGET_S (500: runs not started by then are reported skipped; with the wheels installed first the call fits 10 minutes), WORK
#   (/tmp/s4w_fw: where the runs write; each run's folder is removed after it is measured).
# Output: $OUT/frameworks_<precision>.{json,md,log}, $OUT/env.txt; the table is printed last.
set -u
DIR=${1:?usage: device_frameworks.sh WHEELDIR PRECISION [args...]}; PREC=${2:?precision: bf16 or fp32master}; shift 2
. "$(dirname "$0")/device_env.sh"
device_wheels "$DIR"
device_paths
device_env lightning pytorch_lightning transformers accelerate > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
BUDGET_S=${BUDGET_S:-500}
WORK=${WORK:-/tmp/s4w_fw}; rm -rf "$WORK"; mkdir -p "$WORK"
timeout -k 10 $(( BUDGET_S + 50 )) python3 benchmarks/frameworks.py --precision "$PREC" --out "$OUT" \
  --work "$WORK" --budget-s "$BUDGET_S" "$@" 2> "$OUT/frameworks_$PREC.stderr"
rc=$?
tail -20 "$OUT/frameworks_$PREC.stderr"
exit $rc
