#!/usr/bin/env bash
# A/B of the eager-head leaf fill (dart_ray/verify/logits.py EAGER_HEAD_ROWS): the same bench
# command run from a checkout of the commit before it (OLD) and of this tree (NEW), alternating
# per round, one process per set and version. Within each run, DART/ngram and DART/AR are ratios
# of methods interleaved per prompt in one process, so machine drift between runs cancels.
# (`dart-ray bench` restarts itself under jemalloc: dart_ray/allocator.py.)
#   docs/bench/r17zen4o/ab_leaf_fill.sh OLD_TREE NEW_TREE OUT_DIR "ROUNDS"
set -euo pipefail
# paths absolute: each run cds into its tree
OLD=$(realpath "$1") NEW=$(realpath "$2") OUT=$(realpath -m "$3") ROUNDS=${4:-"1 2"}
BIN=${BIN:-$(pwd)/.venv/bin}   # run from the repository root, or set BIN
mkdir -p "$OUT"
for r in $ROUNDS; do
  if (( r % 2 )); then order="old new"; else order="new old"; fi
  for v in $order; do
    tree=$OLD; [[ $v == new ]] && tree=$NEW
    for set in humaneval chat; do
      extra=(); [[ $set == chat ]] && extra=(--chat)
      (cd "$tree" && PYTHONPATH="$tree" $BIN/dart-ray bench --prompts $set "${extra[@]}" --limit 24 \
        --methods ar,ngram,dart --threads 2 --out "$OUT/$set-$v-r$r.json") > "$OUT/$set-$v-r$r.log" 2>&1
      echo "$(date -u +%H:%M:%S) done $set $v round $r"
    done
  done
done
