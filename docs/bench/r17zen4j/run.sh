#!/bin/bash
# Issue 17, thirteenth sitting (AMD EPYC Zen 4): v10 (runs/v11/v10-drafter, the drafter shipped at 04cedeb) vs
# v11 (runs/v11/drafter/drafter, not shipped), alternating, same N-gram model, nothing else running.
# ROUNDS="1 2" bash docs/bench/r17zen4j/run.sh   (from the repository root)
O=${O:-docs/bench/r17zen4j}
for r in ${ROUNDS:-1}; do
 for set in "humaneval --limit 24" "chat --chat --limit 24"; do
  name=$(echo $set | cut -d' ' -f1)
  for v in v10 v11; do
    case $v in
      v10) extra="--drafter runs/v11/v10-drafter";;
      v11) extra="--drafter ${V11_DRAFTER:-runs/v11/drafter/drafter}";;
    esac
    echo "$(date +%T) $name $v r$r" >> $O/progress.log
    .venv/bin/dart-ray bench --prompts $set --methods ar,ngram,dart --num-threads 2 $extra \
      --out $O/$name-$v-r$r.json > runs/v11/bench-$name-$v-r$r.log 2>&1
  done
 done
done
echo "$(date +%T) done" >> $O/progress.log
