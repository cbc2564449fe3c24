"""CUDA smoke of every path the drafter pipeline uses, on a tiny random Llama (no real weights).

Run before the real GPU training run (``scripts/gpu_drafter.sh``), so a device bug costs a minute,
not the run: the engine's greedy output on the device equals the CPU's (fp32, AR and DART with a
random drafter), then gen-prompts, gen-data (with two-turn rows) and train-drafter (DART + EAGLE
jointly, then DART initialised from the target) on the device, and the trained drafter decoding on
the CPU. Prints one ``smoke: ok`` / ``smoke: FAILED <step>`` line per step; exit 1 on a failure.

    python scripts/gpu_smoke.py TOKENIZER_DIR [cuda]

``TOKENIZER_DIR``: any directory with SmolLM2's tokenizer files (e.g. the converted default model).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

PROMPTS = ["def add(a, b):", "Write a haiku about rain.", "List three colours.", "x = [1, 2, 3]\n"]


def _greedy(model: str, device: str, method: str, drafter: str | None = None) -> list[list[int]]:
    from dart_ray import Engine, EngineConfig, SamplingParams

    eng = Engine.from_config(EngineConfig(model=model, method=method, drafter=drafter,
                                          ngram="none", dtype="fp32", device=device,
                                          max_batch_size=4, adaptive=False))
    return [c.token_ids for c in eng.generate(PROMPTS, SamplingParams(max_new_tokens=24))]


def main(tok_dir: str, dev: str = "cuda") -> int:
    import torch
    from conftest import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    model = str(make_tiny_checkpoint(root / "tiny", "llama", Path(tok_dir)))
    failed = []

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
            print(f"smoke: ok {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception:  # report every step, then fail
            traceback.print_exc()
            print(f"smoke: FAILED {name}", flush=True)
            failed.append(name)

    def engine_equal():
        for method, drafter in (("none", None), ("ngram", None), ("dart", "random")):
            a, b = _greedy(model, "cpu", method, drafter), _greedy(model, dev, method, drafter)
            assert a == b, f"{method}: {dev} greedy differs from cpu"

    def prompts():
        from dart_ray.training.selfinstruct import generate_prompts

        generate_prompts(root / "p", n=8, model=model, dtype="bf16", batch_size=8, shard_size=16,
                         max_shards=1, device=dev, progress=False)
        # the random model's requests are filtered out: hand-written rows feed gen-data
        rows = [{"prompt": f"Explain idea number {i} about {t} in two sentences.",
                 "category": "stem", "subtopic": t, "multi_turn": i % 2 == 0, "source": "chat"}
                for i, t in enumerate(["tides", "magnets", "rain", "stars", "soil", "wind"])]
        (root / "q").mkdir()
        (root / "q" / "prompts-00000.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                                for r in rows))

    def data():
        from dart_ray.training.gen_data import generate_data, write_text_corpus

        write_text_corpus(root / "d", 4000, model)
        generate_data(root / "d", n_code=8, n_chat=6, max_new_tokens=32, batch_size=8,
                      model=model, dtype="bf16", method="none", device=dev, prompts_dir=root / "q",
                      progress=False)

    def train():
        from dart_ray.training.trainer import TrainConfig, train

        base = dict(data=str(root / "d"), model=model, depth=4, seqs_per_step=4, max_len=64,
                    draft_vocab=1024, eval_every=2, eval_seqs=4, device=dev, dtype="bf16")
        train(TrainConfig(out=str(root / "t"), arch="dart", joint=("eagle:3",), max_steps=4,
                          **base), progress=False)
        train(TrainConfig(out=str(root / "u"), arch="dart", init_from_target=True, max_steps=3,
                          **base), progress=False)
        # a time-budget stop, then the same command continues (on the device)
        train(TrainConfig(out=str(root / "u2"), arch="dart", max_steps=6, time_budget_s=1e-6,
                          **base), progress=False)
        s = train(TrainConfig(out=str(root / "u2"), arch="dart", max_steps=6, **base),
                  progress=False)
        assert s["steps"] == 6, s["steps"]

    def trained_drafter_decodes():
        d = str(root / "t" / "dart" / "drafter")
        a, b = _greedy(model, "cpu", "none"), _greedy(model, "cpu", "dart", d)
        assert a == b, "the device-trained drafter changed greedy output on cpu"
        assert _greedy(model, dev, "dart", d) == a, f"{dev} DART greedy differs from cpu AR"

    print("torch", torch.__version__, "device", dev,
          torch.cuda.get_device_name(0) if dev.startswith("cuda") else "", flush=True)
    step("engine greedy equal on device (none, ngram, dart)", engine_equal)
    step("gen-prompts", prompts)
    step("gen-data", data)
    step("train-drafter", train)
    step("device-trained drafter decodes on cpu and device", trained_drafter_decodes)
    print(f"smoke: {'FAILED ' + ', '.join(failed) if failed else 'all ok'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *(sys.argv[2:3] or ["cuda"])))
