#!/usr/bin/env bash
# `make gpu-session`: the GPU rows of a lent GPU machine's short session, in order of value,
# each stage's tables copied to OUT as soon as it finishes, so a run cut off at its limit still
# leaves what it measured. OUT gets session.log (every stage's output), performance.md (the
# ab, finetune and plain stages write its torchtitan-ab, finetune-cuda and cuda-8b blocks) and
# the JSON of ab, rows and ab-rest (their tables are merged into docs/ by hand, so a partial
# stage never overwrites a fuller block).
#
#   OUT=dir DEADLINE_S=540 STAGES="ab rows finetune plain flex ab-rest" bash tools/gpu_session.sh
#
# Stages (each starts only with at least its minimum seconds left before DEADLINE_S):
#   ab        titanlab against torchtitan (tools/benchmark_torchtitan.py): bf16 compile,
#             float8 tensorwise compile, compile + selective AC
#   finetune  LoRA/QLoRA against transformers + peft, with and without Liger, bf16, seq 8192
#             (tools/benchmark_finetune.py --liger)
#   plain     the plain loop at the same 8B-shaped blocks (tools/benchmark.py --gpu-8b), for
#             the trainer / plain-loop ratio
#   rows      the trainer's rows beside bf16 compile: the fused loss in chunks of 2048, Muon,
#             document masks (FlexAttention)
#             (tools/gpu_check.py --skip-tests --skip-torchtitan)
#   flex      masked attention: the FlexAttention GPU tests (pytest -m gpu, the flex files),
#             then FlexAttention against the SDPA path at seq 8192 and 32768
#             (tools/benchmark_flex.py: documents, gpt-oss window + sinks, sinks)
#   ab-rest   the A/B's remaining rows: bf16 eager, float8 rowwise
#   moe       Qwen3-30B-A3B's shape, 4 blocks, 1 GPU: bf16 compiled and eager, float8
#             tensorwise, each measured beside the ledger's prediction for this GPU
#             (tools/gpu_moe_rows.py)
#
# Wheels in .whl/ (`make peer-wheels`: torchtitan, torchdata, torchao, tomli, liger-kernel) are
# installed into /tmp/site first; the machine's own torch, transformers and peft are used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
DEADLINE_S=${DEADLINE_S:-540}
STAGES=${STAGES:-"ab moe rows finetune plain flex ab-rest"}
LAYERS=${LAYERS:-11}
PY=${GPU_PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((DEADLINE_S - ($(date +%s) - START))); }
log() { echo "gpu-session [$(($(date +%s) - START)) s]: $*" | tee -a "$OUT/session.log"; }
save() { cp docs/performance.md "$OUT/performance.md" 2>/dev/null; true; }

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/session.log"

stage() {  # stage NAME MIN_SECONDS: true when it may start
    local l; l=$(left)
    if [ "$l" -lt "$2" ]; then log "stage $1 not run: $l s left, it needs $2"; return 1; fi
    log "stage $1 ($l s left)"
}

for s in $STAGES; do
    case $s in
    ab)
        stage ab 150 && "$PY" tools/benchmark_torchtitan.py --layers "$LAYERS" --steps 9 \
            --warmup 4 --rows "bf16 · compile · AC none,float8 tensorwise,AC selective" \
            --budget-s $(($(left) - 60)) --timeout-s 200 --out /tmp/torchtitan_ab.md \
            --json "$OUT/ab.json" 2>&1 | tee -a "$OUT/session.log" | tail -25
        save ;;
    finetune)
        stage finetune 150 && timeout $(($(left) - 10)) "$PY" tools/benchmark_finetune.py \
            --seq 8192 --hidden 2048 --layers 8 --vocab 128256 --steps 3 --warmup 2 \
            --budget-gib 80 --liger --qlora 2>&1 | tee -a "$OUT/session.log" | tail -25
        save ;;
    plain)
        stage plain 70 && timeout $(($(left) - 5)) "$PY" tools/benchmark.py --matrix none \
            --gpu-8b --gpu-layers "$LAYERS" 2>&1 | tee -a "$OUT/session.log" | tail -15
        save ;;
    rows)
        stage rows 90 && "$PY" tools/gpu_check.py --skip-tests --skip-torchtitan \
            --layers "$LAYERS" --steps 9 --warmup 4 --budget-s $(($(left) - 60)) \
            --rows "loss chunk,Muon,document mask" --out /tmp/gpu_rows.md --perf /tmp/perf_rows.md \
            --json "$OUT/rows.json" 2>&1 | tee -a "$OUT/session.log" | tail -25
        save ;;
    flex)
        stage flex 90 && timeout $(($(left) - 5)) "$PY" -m pytest -q -p no:cacheprovider -m gpu \
            tests/unit/models/common/test_flex_attention_gpu.py \
            tests/unit/models/common/test_document_mask_gpu.py 2>&1 | tee -a "$OUT/session.log" \
            | tail -5
        stage flex-bench 60 && timeout $(($(left) - 5)) "$PY" tools/benchmark_flex.py --write \
            --json "$OUT/flex.json" 2>&1 | tee -a "$OUT/session.log" | tail -10
        save ;;
    ab-rest)
        stage ab-rest 150 && "$PY" tools/benchmark_torchtitan.py --layers "$LAYERS" --steps 9 \
            --warmup 4 --rows "bf16 · eager,float8 rowwise" --budget-s $(($(left) - 60)) \
            --timeout-s 200 --out /tmp/torchtitan_ab_rest.md --perf /tmp/perf_rest.md \
            --json "$OUT/ab_rest.json" 2>&1 | tee -a "$OUT/session.log" | tail -15
        save ;;
    moe)
        stage moe 120 && "$PY" tools/gpu_moe_rows.py --steps 9 --warmup 4 \
            --budget-s $(($(left) - 60)) --timeout-s 200 --out "$OUT/moe.json" 2>&1 \
            | tee -a "$OUT/session.log" | tail -12
        save ;;
    *) log "unknown stage $s (valid: ab moe finetune plain rows flex ab-rest)"; exit 2 ;;
    esac
done
log "done"
