#!/bin/bash
# Issue 17, thirteenth sitting (AMD EPYC Zen 4): v10 (runs/v11/v10-drafter, the drafter shipped at 04cedeb) vs
# v11 (runs/v11/drafter/drafter, not shipped), alternating, same N-gram model, nothing else running.
# ROUNDS="1 2" bash docs/bench/r17zen4j/run.sh   (from the repository root)
LOGS=${LOGS:-runs/v11} exec scripts/bench_drafters.sh "${O:-docs/bench/r17zen4j}" \
  v10=runs/v11/v10-drafter v11="${V11_DRAFTER:-runs/v11/drafter/drafter}"
