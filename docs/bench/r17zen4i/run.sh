#!/bin/bash
# old = HEAD 440bd05 (git archive in /tmp/old), new = this sitting; plain = no allocator env; jem = jemalloc env
J=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
JE="LD_PRELOAD=$J MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1"
O=/work/main/runs/s12
cd /tmp
for r in $ROUNDS; do
 for set in "humaneval --limit 24" "chat --chat --limit 24"; do
  name=$(echo $set | cut -d' ' -f1)
  for v in $VARIANTS; do
    case $v in
      old-plain) cmd="env -u LD_PRELOAD -u MALLOC_CONF PYTHONPATH=/tmp/old /work/main/.venv/bin/python -m dart_ray.cli";;
      new-plain) cmd="env -u LD_PRELOAD -u MALLOC_CONF /work/main/.venv/bin/dart-ray";;
      old-jem) cmd="env $JE PYTHONPATH=/tmp/old /work/main/.venv/bin/python -m dart_ray.cli";;
      new-jem) cmd="env $JE /work/main/.venv/bin/dart-ray";;
    esac
    echo "$(date +%T) $name $v r$r" >> $O/bench1.progress
    $cmd bench --prompts $set --methods ar,ngram,dart --num-threads 2 --out $O/$name-$v-r$r.json > $O/$name-$v-r$r.log 2>&1
  done
 done
done
echo "$(date +%T) done" >> $O/bench1.progress
