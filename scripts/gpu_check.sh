#!/usr/bin/env bash
# GPU checks (run on a machine with CUDA): exactness tests on cuda, bf16 speed, TP over NCCL when
# more than one GPU is visible. Without a GPU it says so and exits 0 (the CPU suite covers logic).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible; nothing to check here."
  exit 0
fi
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0))
PY
export DART_RAY_TEST_DEVICE=cuda
# exactness on CUDA (fp32 forward vs transformers, engine greedy == AR)
"$PY" -m pytest -q tests/models/test_model_forward.py tests/engine/test_engine.py -k "not slow" -x
# speed: own AR vs transformers generate, and the methods, bf16 on cuda
"$PY" -m dart_ray.cli bench --prompts humaneval --limit 20 --methods ar,ngram,dart,hf --dtype bf16 \
  --device cuda --max-new-tokens 128 --out "${OUT:-/tmp}/gpu_bench.json" || true
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -gt 1 ]; then
  "$PY" scripts/tp_check.py "$NGPU" cuda
fi
echo "gpu_check: done"
