#!/bin/bash
# Issue 17, sixteenth sitting (AMD EPYC Zen 4): v10 (runs/v11/v10-drafter, the drafter shipped at 04cedeb) vs
# v14 (runs/v14/drafter/drafter, make drafter-v14), alternating, same N-gram model, nothing else running.
# ROUNDS="1 2" bash docs/bench/r17zen4m/run.sh   (from the repository root)
LOGS=${LOGS:-runs/v14/bench} exec scripts/bench_drafters.sh "${O:-docs/bench/r17zen4m}" \
  v10="${V10_DRAFTER:-runs/v11/v10-drafter}" v14="${V14_DRAFTER:-runs/v14/drafter/drafter}"
