#!/usr/bin/env bash
# Every GPU measurement of the toolkit in one script, each part saved as it ends; each part fits a device call of at
# most 10 minutes (the whole, ~30 minutes on an H200, fits none; a session's 15 minutes hold two calls).
#
#   bash bench/gpu_check.sh [OUT]           # on one H100/H200: its estimate is printed first
#   bash bench/gpu_check.sh --smoke [OUT]   # the same code paths on CPU, tiny shapes: about 3 minutes
#   bash bench/gpu_check.sh --only finetune [OUT]   # one part: throughput (5.5 min), finetune (~8.5, estimated: not
#       yet run), fp8 (9: run already, 2026-11-28), fp8-variants (7.5: not yet run), harness (~4, estimated: not yet
#       run); a session's 15 minutes hold fp8-variants and harness, a call each; canary (~4, estimated: not yet run)
#       fits beside harness
#
# OUT (default $OUT, else ./gpu-check) receives throughput.md / .json (tokens/s, MFU, peak GB and the planner's
# per row, then one profile table per row: device busy %, longest idle gaps, top kernels), finetune.md (issue 65: the
# recipe against transformers.Trainer + peft for SmolLM2-135M LoRA and full and a Llama-3.1-8B-shaped LoRA and QLoRA,
# the planner's peak beside each, and the 8B's longest sequence at micro-batch 1, planned and run), fp8.md /
# fp8-variants.md (issue 46: the 1B YAML as shipped in bf16, then in fp8, 100 steps each with their loss curves side by
# side, and each layer shape timed; fp8-variants.md: 30 steps each of bf16, fp8, fp8 with only the MLP's layers, and
# rowwise), harness.md (eval.harness_tasks in a
# fine-tune and in pretraining, and recipes/evaluate.py under accelerate launch, on the GPU), canary.md (the
# numerics canary's check against a step of the 1B YAML, its share at the default cadence, the largest drift a healthy
# check saw, and the same losses without it) and the log of each part. On a lent
# machine, with the wheels it installs offline in .gpu/ (docs/gpu.md): `source .gpu/setup.sh && bash bench/gpu_check.sh "$OUT"`. The GPU suite
# stays the second command: `python3 -m pytest -m gpu -n 7 tests/recipes/test_gpu_end_to_end.py` (3.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0 ONLY=
while [[ "${1:-}" == --* ]]; do
  case $1 in
    --smoke) SMOKE=1; shift ;;
    --only) [[ ${2:-} ]] || { echo "error: --only needs a part: throughput, finetune, fp8, fp8-variants, harness or canary" >&2; exit 2; }
            ONLY=$2; shift 2 ;;
    *) echo "error: $1: use --smoke and/or --only throughput|finetune|fp8|fp8-variants|harness|canary, then OUT" >&2; exit 2 ;;
  esac
done
case $ONLY in ""|throughput|finetune|fp8|fp8-variants|harness|canary) ;;
  *) echo "error: --only '$ONLY': use throughput, finetune, fp8, fp8-variants, harness or canary" >&2; exit 2 ;; esac
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

# fp8 (issue 46): the same data, seed and steps in bf16 and fp8; the warmup is cut to 10 steps (the YAML's 2000 would
# leave 100 steps at a learning rate too small to move the loss) for both rows alike
if (( SMOKE )); then
  # torchao's casts emulated on CPU (LLM_TOOLKIT_FP8_EMULATE=1: no size rule, no fp8 matmul), the layers compiled
  export LLM_TOOLKIT_FP8_EMULATE=1
  FP8=(--model recipes/configs/pretrain_tiny.yaml --configs fp8-smoke --seq-len 128 --global-batch 16 --steps 4
       --warmup 1 --extra model.config.num_hidden_layers=1 optim.warmup_steps=2)
  FP8_VARIANTS=()
  FP8_LAYERS=(--model recipes/configs/pretrain_tiny.yaml --tokens 256 --repeat 2)
else
  FP8=(--configs fp8 --steps 100 --warmup 3 --row-timeout 260 --extra optim.warmup_steps=10)
  FP8_VARIANTS=(--configs fp8-variants --steps 30 --warmup 3 --row-timeout 160 --extra optim.warmup_steps=10)
  FP8_LAYERS=()
fi

if (( SMOKE )); then
  FINETUNE=(--smoke)
else
  # fine-tuning: 2 untimed and 4 timed steps a row and --budget 540 for the whole (its own estimate, printed first,
  # says how: bench/finetune_throughput.py's ESTIMATE, from the SmolLM2 rows measured on an H200 in 2026-11-27:
  # 118 s, ~35 s more a compiled row; the 8B's load, compile and steps estimated)
  FINETUNE=(--steps 4 --warmup 2 --budget 540)
  # as measured on an H200 (2026-11-27, docs/benchmarks.md): setup 20 s, throughput 321 s; the throughput rows
  # were 3 then as now
  # fp8 on an H200 (2026-11-28): its two 100-step rows 441 s, the layer table 86 s, the rowwise row ~110 s
  echo "== estimate (an H200): throughput 321 s, fine-tuning ~505 s, fp8 527 s, fp8-variants ~440 s, harness ~240 s, canary ~240 s: a call per part (the header's)" >&2
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

[[ -z $ONLY || $ONLY == throughput ]] && part throughput "$PY" bench/gpu_throughput.py "${THROUGHPUT[@]}" --workdir "$WORK" \
  --save "$DEST/throughput.json" --out "$DEST/throughput.md"
[[ -z $ONLY || $ONLY == throughput ]] && [[ -f "$DEST/throughput.md" ]] && cat "$DEST/throughput.md"
[[ -z $ONLY || $ONLY == finetune ]] && part finetune "$PY" bench/finetune_throughput.py "${FINETUNE[@]}" --out "$DEST/finetune.md"
[[ -z $ONLY || $ONLY == finetune ]] && [[ -f "$DEST/finetune.md" ]] && cat "$DEST/finetune.md"
if [[ -z $ONLY || $ONLY == fp8 ]]; then
  part fp8 "$PY" bench/gpu_throughput.py "${FP8[@]}" --strategies ddp --recipe-only --workdir "$WORK" \
    --save "$DEST/fp8.json" --out "$DEST/fp8.md"
  [[ -f "$DEST/fp8.md" ]] && cat "$DEST/fp8.md"
  part fp8-layers "$PY" bench/fp8_layers.py "${FP8_LAYERS[@]}" --out "$DEST/fp8-layers.md"
  [[ -f "$DEST/fp8-layers.md" ]] && cat "$DEST/fp8-layers.md"
fi
if [[ ( -z $ONLY || $ONLY == fp8-variants ) && ${#FP8_VARIANTS[@]} -gt 0 ]]; then
  part fp8-variants "$PY" bench/gpu_throughput.py "${FP8_VARIANTS[@]}" --strategies ddp --recipe-only \
    --workdir "$WORK" --save "$DEST/fp8-variants.json" --out "$DEST/fp8-variants.md"
  [[ -f "$DEST/fp8-variants.md" ]] && cat "$DEST/fp8-variants.md"
fi
if [[ -z $ONLY || $ONLY == harness ]]; then
  part harness "$PY" bench/harness_check.py $( (( SMOKE )) && echo --smoke ) --out "$DEST/harness.md"
  [[ -f "$DEST/harness.md" ]] && cat "$DEST/harness.md"
fi
if [[ -z $ONLY || $ONLY == canary ]]; then
  part canary "$PY" bench/canary_cost.py --compare $( (( SMOKE )) && echo --smoke ) --out "$DEST/canary.md"
  [[ -f "$DEST/canary.md" ]] && cat "$DEST/canary.md"
fi
exit $status
