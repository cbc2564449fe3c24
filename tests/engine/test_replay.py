"""The offline acceptance replay (dart_ray.bench.replay) against the engine it stands in for: the
drafter's candidates it records are the ones a real run drafts at the same positions, and the
acceptance it computes for a budget is what the engine's verify accepts there (fp32, tiny random
target, random DART drafter with prompt-lookup paths so that long paths are accepted too)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import MIXED_PROMPTS

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams
from dart_ray.bench.replay import accepted_by_budget, accepted_paths, collect
from dart_ray.drafters import make_drafter
from dart_ray.models import load_target
from dart_ray.tree import pack_trees

DECODING = DecodingConfig(tree_budget=12, top_k=6, beam_width=4, lookup_paths=2, lookup_len=6,
                          lookup_min_match=1)
NEW = 20


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=512)


def dart_engine(target, adaptive=False, decoding=DECODING):
    cfg = EngineConfig(method="dart", drafter="random", ngram="none", dtype="fp32",
                       max_batch_size=1, max_seq_len=512, decoding=decoding, adaptive=adaptive)
    return Engine(target, make_drafter(cfg, target), cfg)


@pytest.fixture(scope="module")
def observed(tiny):
    """A real greedy run per prompt: at every step, the root's position, the drafter's candidates
    and the draft tokens the verify accepted."""
    eng = dart_engine(tiny)
    dr = eng.drafter
    steps: list[dict] = []
    orig_cand, orig_accept = dr.draft_candidates, eng._accept

    def cand(B, depth, k):
        v, i = orig_cand(B, depth, k)
        steps.append({"root_at": int(eng.cache.lengths[0]), "vals": v[0].clone(),
                      "ids": i[0].clone()})
        return v, i

    def accept(tree, logits, reqs):
        acc = orig_accept(tree, logits, reqs)
        if tree.num_nodes > 1:                              # a decode step (prefill has no tree)
            steps[-1]["accepted"] = int(acc.num_accepted[0])
        return acc

    dr.draft_candidates, eng._accept = cand, accept
    runs = []
    for p in MIXED_PROMPTS:
        steps.clear()
        out = eng.generate(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
        runs.append((eng.encode_prompt(p), out.token_ids, list(steps)))
    return runs


@pytest.fixture(scope="module")
def replay(tiny, observed):
    return collect(dart_engine(tiny), [ids for ids, _, _ in observed], max_new_tokens=NEW,
                   top_k=DECODING.top_k)


def _position(rep, seq: int, root_at: int) -> int:
    hit = np.nonzero((rep.seq_of == seq) & (rep.root_at == root_at))[0]
    assert len(hit) == 1, (seq, root_at)
    return int(hit[0])


def test_replay_records_the_references_and_every_position(observed, replay):
    for s, (ids, out, _) in enumerate(observed):
        assert replay.seqs[s].tolist() == list(ids) + list(out)
        roots = replay.root_at[replay.seq_of == s].tolist()
        assert roots == list(range(len(ids), len(ids) + len(out) - 1))
    depth = min(DECODING.draft_depth, 8)                      # the random drafter is 8 deep
    assert replay.vals.shape == (replay.num_positions, depth, DECODING.top_k)


def test_replay_candidates_are_the_ones_a_real_run_drafts(observed, replay):
    checked = 0
    for s, (_, _, steps) in enumerate(observed):
        for st in steps:
            i = _position(replay, s, st["root_at"])
            d = st["ids"].shape[0]
            assert replay.ids[i, :d].tolist() == st["ids"].tolist()
            torch.testing.assert_close(torch.from_numpy(replay.vals[i, :d]), st["vals"],
                                       rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 30


def test_replay_acceptance_is_what_the_engine_accepted(tiny, observed, replay):
    # the run's own candidates at the positions it visited (a random drafter's near-uniform levels
    # make near-tied path scores, which the replay's ~1e-6 different logits may order otherwise)
    rep = copy.deepcopy(replay)
    at = []
    for s, (_, _, steps) in enumerate(observed):
        for st in steps:
            i = _position(rep, s, st["root_at"])
            d = st["ids"].shape[0]
            rep.vals[i, :d], rep.ids[i, :d] = st["vals"].numpy(), st["ids"].numpy()
            # the reference ends at max_new_tokens; the engine's last step may accept past it
            left = len(rep.seqs[s]) - 1 - st["root_at"]
            at.append((i, min(st["accepted"], left)))
    full = DECODING.tree_budget + DECODING.lookup_paths * DECODING.lookup_len
    acc = accepted_by_budget(rep, DECODING, None, [full])[full]   # the engines run without N-grams
    pairs = [(int(acc[i]), accepted) for i, accepted in at]
    assert [a for a, _ in pairs] == [b for _, b in pairs]
    assert max(b for _, b in pairs) >= 3              # lookup paths: long paths are checked too


def test_acceptance_never_falls_as_the_budget_grows(tiny, replay):
    """...and the first m nodes of the full tree accept what the engine's budget-m step does: its
    search runs with the budget-m knobs (``_first_nodes_knobs``) and is cut to m nodes."""
    from dart_ray.engine.engine import _first_nodes_knobs

    sizes = [1, 2, 4, 8, 16, 24]
    acc = accepted_by_budget(replay, DECODING, None, sizes)
    for a, b in zip(sizes, sizes[1:], strict=False):
        assert (acc[a] <= acc[b]).all()
        assert (acc[a] <= a).all()
    for m in sizes:
        own = accepted_by_budget(replay, _first_nodes_knobs(DECODING, m), None, [m])[m]
        assert (own == acc[m]).all(), m


def test_accepted_paths_follow_parents_and_depths():
    # root -> 5 -> 6 -> 7 and root -> 9 -> 6: the reference 5 6 8 accepts nodes 1 and 2 only
    tree = pack_trees(torch.tensor([0]), [([5, 6, 7, 9, 6], [0, 1, 2, 0, 4])])
    on = accepted_paths(tree, np.array([[5, 6, 8]]))
    assert on[0].tolist() == [True, True, True, False, False, False]
    on = accepted_paths(tree, np.array([[9, 6, -1]]))
    assert on[0].tolist() == [True, False, False, False, True, True]


def test_simulate_at_flat_prices_is_tokens_per_step(replay):
    from conftest import flat_cost

    from dart_ray.bench.replay import simulate

    full = DECODING.tree_budget + DECODING.lookup_paths * DECODING.lookup_len
    res = simulate(replay, DECODING, None, flat_cost(0.01), draft_s=0.0, overhead_s=0.0,
                   plain_overhead_s=0.0, fixed=full)
    assert res.tokens_per_step > 1.2                  # the copies in the prompts are accepted
    assert res.speedup == pytest.approx(res.tokens_per_step)
    assert {n for _, n in res.sizes} == {full}
    one = simulate(replay, DECODING, None, flat_cost(0.01), draft_s=0.0, overhead_s=0.0,
                   plain_overhead_s=0.0, fixed=1)
    assert 1.0 <= one.tokens_per_step <= 2.0 and one.tokens_per_step < res.tokens_per_step


def test_simulated_controller_stays_plain_where_drafting_costs_more_than_it_brings(replay):
    from conftest import COST_GRID_B, COST_GRID_T

    from dart_ray.bench.replay import simulate
    from dart_ray.engine.cost import CostModel

    steep = CostModel.from_function(lambda b, t: 0.01 * t, COST_GRID_B, COST_GRID_T)
    res = simulate(replay, DECODING, None, steep, draft_s=0.02, overhead_s=0.0,
                   plain_overhead_s=0.0)
    plain_steps = sum(c for (_, n), c in res.sizes.items() if n == 0)
    assert plain_steps >= 0.6 * sum(res.sizes.values())
    assert res.speedup > 0.6
