#!/bin/bash
# Issue 17, fifteenth sitting (AMD EPYC Zen 4): v10 (runs/v11/v10-drafter, the drafter shipped at 04cedeb) vs
# v13 (runs/v13/drafter/drafter, not shipped), alternating, same N-gram model, nothing else running.
# ROUNDS="1 2" bash docs/bench/r17zen4l/run.sh   (from the repository root)
LOGS=${LOGS:-runs/v13/bench} exec scripts/bench_drafters.sh "${O:-docs/bench/r17zen4l}" \
  v10=runs/v11/v10-drafter v13="${V13_DRAFTER:-runs/v13/drafter/drafter}"
