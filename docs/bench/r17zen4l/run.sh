#!/bin/bash
# Issue 17, fifteenth sitting (AMD EPYC Zen 4): v10 (runs/v11/v10-drafter, the drafter shipped at 04cedeb) vs
# v13 (runs/v13/drafter/drafter, not shipped), alternating, same N-gram model, nothing else running.
# ROUNDS="1 2" bash docs/bench/r17zen4l/run.sh   (from the repository root)
O=${O:-docs/bench/r17zen4l}
mkdir -p runs/v13/bench
for r in ${ROUNDS:-1}; do
 for set in "humaneval --limit 24" "chat --chat --limit 24"; do
  name=$(echo $set | cut -d' ' -f1)
  for v in v10 v13; do
    case $v in
      v10) extra="--drafter runs/v11/v10-drafter";;
      v13) extra="--drafter ${V13_DRAFTER:-runs/v13/drafter/drafter}";;
    esac
    echo "$(date +%T) $name $v r$r" >> $O/progress.log
    .venv/bin/dart-ray bench --prompts $set --methods ar,ngram,dart --num-threads 2 $extra \
      --out $O/$name-$v-r$r.json > runs/v13/bench/$name-$v-r$r.log 2>&1 || exit 1
  done
 done
done
echo "$(date +%T) done" >> $O/progress.log
