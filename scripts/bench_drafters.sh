#!/bin/bash
# End-to-end A/B of drafters (bs 1): for each round, each set (HumanEval, the chat set; 24 prompts) and each
# drafter in the order given, `dart-ray bench --methods ar,ngram,dart` with that drafter -- run alone on the cores.
#   ROUNDS="1 2" scripts/bench_drafters.sh OUT_DIR NAME=DRAFTER_DIR[@NGRAM_DIR] [NAME=DRAFTER_DIR[@NGRAM_DIR] ...]
# (@NGRAM_DIR: that N-gram model instead of the shipped one, for dart and ngram alike);
# ONE_RUN=1: instead, per round and set, ONE bench process runs ar, ngram and every drafter as `dart@NAME`,
# interleaved per prompt (no run-to-run drift between the drafters; no @NGRAM_DIR), writing {set}-rR.json;
# writes OUT_DIR/{humaneval,chat}-NAME-rR.json, the bench logs beside them under OUT_DIR/logs (git-ignored
# runs/ is a good place for those: LOGS=runs/...), and OUT_DIR/progress.log. From the repository root.
set -u
[ $# -ge 2 ] || { echo "usage: ROUNDS=\"1 2\" $0 OUT_DIR NAME=DRAFTER_DIR[@NGRAM_DIR] ..." >&2; exit 2; }
O=$1; shift
LOGS=${LOGS:-$O/logs}
for pair in "$@"; do
  spec=${pair#*=}
  for d in "${spec%@*}" $([ "$spec" != "${spec#*@}" ] && echo "${spec#*@}"); do
    [ -e "$d" ] || { echo "$0: $d (from $pair) does not exist" >&2; exit 2; }
  done
done
mkdir -p "$O" "$LOGS"
if [ "${ONE_RUN:-0}" = 1 ]; then
  methods=ar,ngram; flags=()
  for pair in "$@"; do
    [ "${pair#*@}" = "$pair" ] || { echo "$0: ONE_RUN=1 takes no @NGRAM_DIR ($pair)" >&2; exit 2; }
    methods="$methods,dart@${pair%%=*}"; flags+=(--drafter-for "dart@${pair%%=*}=${pair#*=}")
  done
fi
# bench LABEL ARGS...: one `dart-ray bench` of the current set ($set, $name) and round ($r), logged
bench() {
  local f="$name${1:+-$1}-r$r"; shift
  echo "$(date +%T) $f" >> "$O/progress.log"
  .venv/bin/dart-ray bench --prompts $set --num-threads 2 "$@" --out "$O/$f.json" > "$LOGS/$f.log" 2>&1 \
    || { echo "$0: see $LOGS/$f.log" >&2; exit 1; }
}
for r in ${ROUNDS:-1}; do
  for set in "humaneval --limit 24" "chat --chat --limit 24"; do
    name=${set%% *}
    if [ "${ONE_RUN:-0}" = 1 ]; then
      bench "" --methods "$methods" "${flags[@]}"
      continue
    fi
    for pair in "$@"; do
      spec=${pair#*=}
      ngram=(); [ "$spec" != "${spec#*@}" ] && ngram=(--ngram "${spec#*@}")
      bench "${pair%%=*}" --methods ar,ngram,dart --drafter "${spec%@*}" "${ngram[@]}"
    done
  done
done
echo "$(date +%T) done" >> "$O/progress.log"
