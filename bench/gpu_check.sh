#!/usr/bin/env bash
# Every GPU measurement of the toolkit in one command (one 10-minute device run at most), each part saved as it ends.
#
#   bash bench/gpu_check.sh [OUT]           # on one H100/H200: its estimate is printed first
#   bash bench/gpu_check.sh --smoke [OUT]   # the same code paths on CPU, tiny shapes: about 3 minutes
#   bash bench/gpu_check.sh --only finetune [OUT]   # one part (throughput or finetune): two device calls in a row
#
# OUT (default $OUT, else ./gpu-check) receives throughput.md / .json (tokens/s, MFU, peak GB and the planner's
# per row, then one profile table per row: device busy %, longest idle gaps, top kernels), finetune.md (the recipe
# against transformers.Trainer, LoRA and full) and the log of each part. On a lent
# machine (../shared/gpu/README.md): `source .gpu/setup.sh && bash bench/gpu_check.sh "$OUT"`. The GPU suite
# stays the second command: `python3 -m pytest -m gpu -n 7 tests/recipes/test_gpu_end_to_end.py` (3.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0 ONLY=
while [[ "${1:-}" == --* ]]; do
  case $1 in
    --smoke) SMOKE=1; shift ;;
    --only) [[ ${2:-} ]] || { echo "error: --only needs a part: throughput or finetune" >&2; exit 2; }
            ONLY=$2; shift 2 ;;
    *) echo "error: $1: use --smoke and/or --only throughput|finetune, then OUT" >&2; exit 2 ;;
  esac
done
case $ONLY in ""|throughput|finetune) ;; *) echo "error: --only '$ONLY': use throughput or finetune" >&2; exit 2 ;; esac
DEST=${1:-${OUT:-gpu-check}}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if (( SMOKE )); then
  # pretrain_tiny's shape, 2 timed steps: check's two recipe rows with the full form's code paths (the 1B YAML's
  # switches: compiled layers and the chunked loss; the whole model compiled with its loss), and plain loop (a). CPU
  # has no backward for flex_attention, which the 1B YAML and loops (b) and (c) use: the rows take sdpa here. One
  # decoder layer in the recipe rows: the whole model's graph holds every layer, and its cold compile is most of a row
  THROUGHPUT=(--model recipes/configs/pretrain_tiny.yaml --configs smoke --strategies ddp
              --peer-variants a --seq-len 128 --global-batch 16 --steps 2 --warmup 1 --profile 1
              --extra model.config.num_hidden_layers=1)
else
  # The 1B YAML. Rows: as it ships (no recomputation, micro-batch 16), the whole model compiled (micro-batch 8), and
  # plain loop (c), the bar, each with 2 profiled steps (most of a row is start-up and compiling).
  THROUGHPUT=(--configs check --strategies ddp --peer-variants c --steps 10 --warmup 3
              --profile 2 --row-timeout 240)
fi

if (( SMOKE )); then
  FINETUNE=(--smoke)
else
  FINETUNE=(--steps 10 --warmup 3)
  # as measured on an H200 (../shared/gpu/runs/2026-11-27-h200): setup 20 s, throughput 321 s, fine-tuning 118 s
  # before its two rows with the whole model compiled (~35 s each, compiling); the throughput rows were 3 then as now
  echo "== estimate (an H200, 2026-11-27): setup 20 s + throughput 321 s + fine-tuning 118 s + 2 compiled fine-tune rows ~35 s each = ~530 s, 8.8 minutes" >&2
fi

status=0
part() {  # NAME CMD...: one part, its log in DEST, its time said; a failed part fails the command, the rest still run
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" >&2
  "$@" > "$DEST/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( SECONDS - t0 )) s" >&2
  (( rc == 0 )) || { status=1; tail -20 "$DEST/$name.log" >&2; }
}

[[ $ONLY == finetune ]] || part throughput "$PY" bench/gpu_throughput.py "${THROUGHPUT[@]}" --workdir "$WORK" \
  --save "$DEST/throughput.json" --out "$DEST/throughput.md"
[[ $ONLY != finetune && -f "$DEST/throughput.md" ]] && cat "$DEST/throughput.md"
[[ $ONLY == throughput ]] || part finetune "$PY" bench/finetune_throughput.py "${FINETUNE[@]}" --out "$DEST/finetune.md"
[[ $ONLY != throughput && -f "$DEST/finetune.md" ]] && cat "$DEST/finetune.md"
exit $status
