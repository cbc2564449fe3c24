"""Tensor parallelism: the sharding transform, and TP engines equal TP=1 token for token (fp32).

* In one process: shards of a random model, with an all-reduce simulated across threads, give the
  unsharded model's logits and taps (even and uneven head splits, biases, Qwen3 q/k norms, ties).
* Real gloo groups: TP=2 with a spawned follower process (tiny model; SmolLM2 under ``slow``)
  and TP=2 with a Ray worker actor in a placement group (``serve``) match TP=1's greedy tokens,
  for DART (random drafter) and plain AR sharing one group.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import spread_weights

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams
from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.models.args import ModelArgs
from dart_ray.models.llama import Transformer
from dart_ray.parallel import (
    RowParallelLinear,
    apply_tensor_parallel,
    new_tp_cache,
    shard_plan,
    split_sizes,
)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "Hello"]
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
SMALL_TREE = DecodingConfig(draft_depth=4, tree_budget=16, top_k=6, beam_width=4)


# ---- the transform, in one process ------------------------------------------------------------
def random_model(seed: int = 0, **overrides) -> Transformer:
    shape = dict(model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=100,
                 num_layers=3, num_heads=6, num_kv_heads=3, head_dim=8)
    shape.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**shape), max_seq_len=64)
    spread_weights(model, 0.15, 0.1)
    return model.eval().requires_grad_(False)


class ThreadAllReduce:
    """Sum over ``world`` threads (one per simulated rank), in rank order, for every rank."""

    def __init__(self, world: int) -> None:
        self.parts: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def for_rank(self, r: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[r] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()          # everyone has read the parts before the next round writes
            t.copy_(total)

        return all_reduce


def run_steps(model, cache, taps=(0, 2)):
    """Prefill two rows of different lengths, then one tree-verify step; returns both outputs."""
    g = torch.Generator().manual_seed(1)
    V = model.args.vocab_size
    lens = [7, 5]
    tokens = torch.randint(0, V, (2, 7), generator=g)
    positions = torch.arange(7).expand(2, 7)
    mask = attention_mask([0, 0], causal_ancestors(7), 7, torch.float32)
    pre = model(tokens, positions, mask, cache, rows=slice(0, 2), starts=[0, 0], taps=taps)
    cache.commit_all(slice(0, 2), lens)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tree = torch.randint(0, V, (2, 4), generator=g)
    depths = torch.tensor([0, 1, 1, 2])
    pos = torch.tensor(lens)[:, None] + depths
    mask = attention_mask(lens, anc, max(lens) + 4, torch.float32)
    ver = model(tree, pos, mask, cache, rows=slice(0, 2), starts=lens, taps=taps)
    return pre, ver


def run_sharded(model, world: int):
    """The same steps on ``world`` shards (threads + simulated all-reduce); every rank's outputs."""
    comm = ThreadAllReduce(world)
    shards = [apply_tensor_parallel(copy.deepcopy(model), r, world, all_reduce=comm.for_rank(r))
              for r in range(world)]
    with ThreadPoolExecutor(world) as ex:
        futs = [ex.submit(run_steps, s, new_tp_cache(s, 2, 32)) for s in shards]
        return shards, [f.result(timeout=60) for f in futs]


CASES = {
    "even-gqa": dict(num_heads=4, num_kv_heads=2),
    "uneven-gqa": dict(),                                        # 6 q / 3 kv heads over 2 ranks
    "mha-3-ranks": dict(num_heads=4, num_kv_heads=4, world=3),   # kv 2/1/1, intermediate 34/33/33
    "qwen2-bias": dict(model_type="qwen2", qkv_bias=True),
    "qwen3-qk-norm": dict(model_type="qwen3", qk_norm=True, world=3),
    "o-bias-tied": dict(qkv_bias=True, o_bias=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shards_sum_to_the_model(case):
    torch.set_num_threads(1)
    over = dict(CASES[case])
    world = over.pop("world", 2)
    model = random_model(**over)
    ref_pre, ref_ver = run_steps(model, model.new_cache(2, 32))
    shards, outs = run_sharded(model, world)
    a = model.args
    for r, (s, (pre, ver)) in enumerate(zip(shards, outs, strict=True)):
        plan = shard_plan(a, r, world)
        assert s.layers[0].attn.qkv.weight.shape[0] \
            == (plan.num_heads + 2 * plan.num_kv_heads) * a.head_dim
        assert isinstance(s.layers[0].attn.o, RowParallelLinear) \
            and isinstance(s.layers[0].mlp.down, RowParallelLinear)
        assert (s.layers[0].attn.o.bias is not None) == (a.o_bias and r == 0)
        for got, want in ((pre, ref_pre), (ver, ref_ver)):
            torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(got.taps, want.taps, atol=2e-5, rtol=1e-5)
        assert ver.logits.argmax(-1).equal(ref_ver.logits.argmax(-1))
    assert sum(shard_plan(a, r, world).num_kv_heads for r in range(world)) == a.num_kv_heads


def test_plan_and_errors():
    assert split_sizes(3, 2) == [2, 1] and split_sizes(130, 3) == [44, 43, 43]
    a = random_model().args                                     # 6 heads, 3 kv heads
    plans = [shard_plan(a, r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in plans] == [((0, 4), (0, 2)), ((4, 6), (2, 3))]
    with pytest.raises(ValueError, match="cannot split 3 KV heads over 4 ranks"):
        shard_plan(a, 0, 4)
    with pytest.raises(ValueError, match="rank must be"):
        shard_plan(a, 2, 2)
    m = random_model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert apply_tensor_parallel(m, 0, 1) is m                  # world 1: identity
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert m.local_kv_heads == 3 and not isinstance(m.layers[0].attn.o, RowParallelLinear)
    s = apply_tensor_parallel(random_model(), 1, 2, all_reduce=lambda t: None)
    with pytest.raises(ValueError, match="already sharded"):
        apply_tensor_parallel(s, 1, 2)
    assert new_tp_cache(s, 2, 16).k.shape == (3, 2, 1, 16, 8)


def test_tp1_through_the_proxy_equals_engine(tiny_tp_dir):
    """The TP code path with one rank (no torch.distributed) is the plain engine."""
    from dart_ray.parallel import start_local_tp

    cfg = tp_config(tiny_tp_dir, "dart")
    ref = reference(cfg)
    with start_local_tp(cfg, 1) as g:
        assert type(g.engine.model).__name__ == "TPModelProxy"
        assert [c.token_ids for c in g.engine.generate(PROMPTS, GREEDY)] == ref


# ---- real groups --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tp_dir(tmp_path_factory, smollm_dir):
    """Tiny random Llama with 6 q / 3 kv heads and an odd intermediate size: TP=2 splits
    unevenly."""
    from conftest import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tp") / "llama", "llama", smollm_dir,
                                seed=3, hidden_size=96, num_attention_heads=6,
                                num_key_value_heads=3, intermediate_size=130, attention_bias=True)


def tp_config(model, method: str, max_seq_len: int = 512) -> EngineConfig:
    return EngineConfig(model=str(model), method=method,
                        drafter="random" if method == "dart" else None,
                        ngram="none", dtype="fp32", max_batch_size=4, max_seq_len=max_seq_len,
                        num_threads=1, decoding=SMALL_TREE)


def reference(cfg: EngineConfig, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    torch.set_num_threads(1)
    eng = Engine.from_config(cfg.replace(method="none"))
    return [eng.generate(p, params)[0].token_ids for p in prompts]


def lane(main: Engine, method: str) -> Engine:
    """A second engine on the same (TP) target, as Serve's lanes build them: own cache and
    drafter."""
    from dart_ray.drafters import make_drafter

    cfg = main.config.replace(method=method)
    return Engine(main.target, make_drafter(cfg, main.target), cfg)


def check_group(engine: Engine, prompts, params, ref) -> None:
    """DART (batched) and AR (batch 1, a lane sharing the group) both equal TP=1; ranks agree."""
    assert [c.token_ids for c in engine.generate(prompts, params)] == ref
    ar = lane(engine, "none")
    assert [ar.generate(p, params)[0].token_ids for p in prompts] == ref
    report = engine.model.rank_lengths()
    assert len(report) == 2 and report[0] == report[1] and len(report[0]) == 2


def test_start_local_tp_refuses_a_size_below_one(tiny_tp_dir):
    from dart_ray.parallel import start_local_tp

    for world in (0, -1, 1.5):
        with pytest.raises(ValueError, match="tensor-parallel size must be an integer >= 1"):
            start_local_tp(tp_config(tiny_tp_dir, "none"), world)


@pytest.mark.timeout(240)
def test_gloo_tp2_equals_tp1(tiny_tp_dir):
    from dart_ray.parallel import start_local_tp

    cfg = tp_config(tiny_tp_dir, "dart")
    ref = reference(cfg)
    with start_local_tp(cfg, 2, timeout_s=60, load_timeout_s=120) as g:
        assert g.engine.model.tp.world == 2
        check_group(g.engine, PROMPTS, GREEDY, ref)
    assert all(p.exitcode == 0 for p in g.processes)


@pytest.mark.timeout(120)
def test_follower_death_fails_fast(tiny_tp_dir):
    """A dead follower makes rank 0's next command raise at once (no hang), and marks the group
    failed."""
    import signal
    import time

    from dart_ray.parallel import start_local_tp

    cfg = tp_config(tiny_tp_dir, "none").replace(max_batch_size=1)
    with start_local_tp(cfg, 2, timeout_s=30, load_timeout_s=120) as g:
        assert len(g.engine.generate("Hello", SamplingParams(max_new_tokens=3))[0].token_ids) == 3
        os.kill(g.processes[0].pid, signal.SIGKILL)
        g.processes[0].join(10)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError):
            g.engine.generate("Hello", SamplingParams(max_new_tokens=3))
        assert time.perf_counter() - t0 < 35
        with pytest.raises(RuntimeError, match="group failed"):
            g.engine.model.check_health()


def follower_failing_one_commit(rank, world, init_method, cfg, timeout_s, load_timeout_s):
    """A follower (spawned process entry) whose third KV-cache commit fails: an error of this
    rank alone, after which its cache would differ from rank 0's."""
    from dart_ray import kv_cache
    from dart_ray.parallel.launch import tp_worker_main

    commit, calls = kv_cache.KVCache.commit, [0]

    def failing_commit(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected follower commit failure")
        return commit(self, *args, **kwargs)

    kv_cache.KVCache.commit = failing_commit
    tp_worker_main(rank, world, init_method, cfg, timeout_s, load_timeout_s)


@pytest.mark.timeout(180)
def test_a_follower_error_of_its_own_fails_the_group_not_the_output(tiny_tp_dir):
    """A follower whose command fails there alone leaves the group: rank 0's next collective fails
    at once (well inside the collective timeout) and the group is marked failed -- the follower
    never decodes on with a KV cache that differs from rank 0's (silently wrong tokens)."""
    import time

    import torch.multiprocessing as mp

    from dart_ray.parallel.launch import (
        LocalTPGroup,
        build_tp_engine,
        free_port,
        init_tp_group,
    )

    cfg = tp_config(tiny_tp_dir, "dart").replace(max_batch_size=2)
    init = f"tcp://127.0.0.1:{free_port()}"
    proc = mp.get_context("spawn").Process(target=follower_failing_one_commit,
                                           args=(1, 2, init, cfg, 60.0, 120.0), daemon=True)
    proc.start()
    tp = init_tp_group(0, 2, init, "cpu", 60.0)
    g = LocalTPGroup(build_tp_engine(cfg, tp, 120.0), tp, [proc])
    try:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError):
            g.engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert time.perf_counter() - t0 < 30
        with pytest.raises(RuntimeError, match="group failed"):
            g.engine.model.check_health()
        proc.join(30)
        assert proc.exitcode not in (None, 0)          # the follower left with its error
    finally:
        g.shutdown(timeout_s=10)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gloo_tp2_smollm_equals_tp1(smollm_dir):
    from dart_ray.parallel import start_local_tp

    prompts = ["def fibonacci(n):", "Write a short poem about rain."]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    cfg = tp_config(smollm_dir, "dart", max_seq_len=256)
    ref = reference(cfg, prompts, params)
    with start_local_tp(cfg, 2, timeout_s=60, load_timeout_s=180) as g:
        plan = g.engine.model.model.tp_plan  # 9 q / 3 kv heads: rank 0 holds 2 KV groups
        assert plan.kv_heads == (0, 2) and plan.q_heads == (0, 6)
        check_group(g.engine, prompts, params, ref)
    assert all(p.exitcode == 0 for p in g.processes)


# ---- Ray: rank 0 in a task, rank 1 a worker actor, both in one placement group -------------------
def _rank0_on_ray(cfg: EngineConfig, pg, prompts, params) -> dict:
    """Runs where a Serve replica would (bundle 0): start the group, generate, shut down."""
    import torch

    from deployments.tp import start_tp_group

    torch.set_num_threads(1)
    g = start_tp_group(cfg, 2, placement_group=pg, num_cpus_per_worker=0.5, timeout_s=60,
                       load_timeout_s=120)
    try:
        g.check_health()
        dart = [c.token_ids for c in g.engine.generate(prompts, params)]
        ar_engine = lane(g.engine, "none")
        ar = [ar_engine.generate(p, params)[0].token_ids for p in prompts]
        return {"dart": dart, "ar": ar, "report": g.engine.model.rank_lengths()}
    finally:
        g.shutdown(timeout_s=30)


@pytest.mark.serve
@pytest.mark.timeout(240)
def test_ray_tp2_equals_tp1(tiny_tp_dir):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from deployments.placement import placement_options

    if ray.is_initialized():
        pytest.skip("Ray is already running in this process")
    cfg = tp_config(tiny_tp_dir, "dart")
    ref = reference(cfg)
    tmp = tempfile.mkdtemp(prefix="drtp-", dir="/tmp")  # short: Ray's socket paths must fit
    from dart_ray import init_ray

    init_ray(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        opts = placement_options(2, "cpu", 0.5)
        pg = placement_group(opts["placement_group_bundles"],
                             strategy=opts["placement_group_strategy"])
        ray.get(pg.ready(), timeout=60)
        task = ray.remote(_rank0_on_ray).options(
            num_cpus=0.5, max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0))
        out = ray.get(task.remote(cfg, pg, PROMPTS, GREEDY), timeout=200)
        assert out["dart"] == ref and out["ar"] == ref
        assert len(out["report"]) == 2 and out["report"][0] == out["report"][1]
        remove_placement_group(pg)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
