"""Speed that survives the machine: dtype auto, the measured cost model, the adaptive controller,
drafters that survive skipped steps, lazy LM-head logits, and exact token/usage accounting.

Controller decisions are tested on synthetic cost models (no timing in assertions); exactness with
the controller on is tested in fp32 on tiny random targets."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import COST_GRID_B as GRID_B
from conftest import COST_GRID_T as GRID_T
from conftest import MIXED_PROMPTS, flat_cost

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams
from dart_ray.drafters import make_drafter
from dart_ray.engine.controller import (
    ContextualController,
    ControllerConfig,
    SpeculationController,
    accepted_within,
    ladder_upto,
)
from dart_ray.engine.cost import CostModel, load_or_measure, measure_verify_costs
from dart_ray.models import load_target
from dart_ray.tree import TokenTree, pack_trees
from dart_ray.tree.search import build_trees
from dart_ray.verify import RequestRandom, accept, greedy_accept, sample_accept
from dart_ray.verify.logits import NodeLogits, internal_nodes

PROMPTS = MIXED_PROMPTS
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=512)


def make_engine(target, method="dart", drafter="random", batch=4, cost=None, adaptive=True, **dec):
    decoding = DecodingConfig(**{"tree_budget": 24, "top_k": 8, "beam_width": 6, **dec})
    cfg = EngineConfig(method=method, drafter=drafter, ngram="none", dtype="fp32",
                       max_batch_size=batch, max_seq_len=512, decoding=decoding, adaptive=adaptive)
    return Engine(target, make_drafter(cfg, target), cfg, cost_model=cost or flat_cost())


# ---- cost model ----------------------------------------------------------------------------------

def test_cost_model_interpolates_extrapolates_and_learns():
    cm = CostModel.from_function(lambda b, t: 0.01 + 0.001 * b * t, [1, 4], [1, 5, 9])
    assert cm.verify_s(1, 1) == pytest.approx(0.011)
    assert cm.verify_s(1, 3) == pytest.approx(0.013)           # between grid points
    assert cm.verify_s(1, 17) == pytest.approx(0.019 * 17 / 9)  # beyond the grid: proportional
    noisy = CostModel.from_function(lambda b, t: {1: 0.01, 5: 0.03, 9: 0.02}[t], [1], [1, 5, 9])
    assert noisy.verify_s(1, 9) == pytest.approx(0.03)         # monotone despite noise
    assert noisy.verify_s(1, 18) == pytest.approx(0.06)        # and never flat beyond
    assert cm.verify_s(2, 5) == pytest.approx(0.02)            # between batch sizes
    assert cm.verify_s(8, 1) > cm.verify_s(4, 1)               # beyond the largest batch
    before = cm.verify_s(1, 5)
    for _ in range(50):
        cm.observe(1, 5, 2 * before)                           # the machine is slower than measured
    assert cm.verify_s(1, 5) == pytest.approx(2 * before, rel=0.05)
    assert cm.verify_s(4, 9) == pytest.approx(0.01 + 0.036)    # other cells untouched
    again = CostModel.from_dict(cm.to_dict())
    assert again.verify_s(1, 5) == pytest.approx(cm.verify_s(1, 5))


def test_cost_model_refinement_tracks_a_cell_hidden_by_a_dear_smaller_one():
    # a cold first measurement made the plain step look dearer than a 9-token forward; steps that
    # keep verifying 9 tokens at 24 ms must converge there -- not shrink the cell toward zero
    # (the running maximum hides it) and not leave the plain step priced above it
    cm = CostModel.from_function(lambda b, t: {1: 0.029, 5: 0.021, 9: 0.024, 17: 0.03}[t], [1],
                                 [1, 5, 9, 17])
    for _ in range(300):
        cm.observe(1, 9, 0.024)
    assert cm.table[(1, 9)] == pytest.approx(0.024, rel=0.02)
    assert cm.verify_s(1, 9) == pytest.approx(0.024, rel=0.02)
    assert cm.verify_s(1, 1) <= 0.0241                       # a smaller forward never costs more
    assert cm.verify_s(1, 17) == pytest.approx(0.03)          # larger cells untouched


def test_cost_model_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_RAY_CACHE", str(tmp_path))
    calls = []
    fwd = lambda b, t: calls.append((b, t))                      # noqa: E731
    cm = load_or_measure("k", {"cpu": "x"}, fwd, [1, 4], [1, 5, 65])
    assert (4, 65) not in cm.table and (1, 65) in cm.table       # B*T above the bound: extrapolated
    n = len(calls)
    assert n == 2 * len(cm.table) + 2                     # warm-up, then best of two per cell
    assert calls[:2] == [(1, 1), (1, 1)]
    cm2 = load_or_measure("k", {"cpu": "x"}, fwd, [1, 4], [1, 5, 65])
    assert len(calls) == n and cm2.table == cm.table             # cached: nothing re-measured
    assert measure_verify_costs(fwd, [16], [1, 65], max_tokens=100).keys() == {(16, 1)}


# ---- controller decisions ------------------------------------------------------------------------

def trained(ctrl: SpeculationController, B: int, accepted: list[int], n_used: int, steps: int = 60,
            draft_s: float = 0.001, overhead_s: float = 0.001) -> None:
    """Feed steps whose rows accept chains through nodes 1, 2, ... of the lengths ``accepted``
    (cycled over rows and steps)."""
    i = 0
    for _ in range(steps):
        paths = []
        for _ in range(B):
            paths.append(list(range(1, min(accepted[i % len(accepted)], n_used) + 1)))
            i += 1
        ctrl.record(B, n_used, paths, draft_s=draft_s, verify_s=0.0, tokens_per_row=n_used + 1,
                    overhead_s=overhead_s)


def test_controller_picks_ar_when_verification_is_too_dear():
    # an AVX2-like machine: every extra token costs as much as a whole step
    cost = CostModel.from_function(lambda b, t: 0.02 * t, GRID_B, GRID_T)
    ctrl = SpeculationController(cost)
    trained(ctrl, 1, [0, 1, 0, 3], 32)                                # tau 2 at most
    assert ctrl.best(1, 32) == 0


def test_controller_picks_large_trees_when_acceptance_is_high_and_verify_cheap():
    # a GPU-like machine: verify is flat in tree size
    ctrl = SpeculationController(flat_cost())
    trained(ctrl, 1, [64, 20, 40], 64)
    assert ctrl.best(1, 64) == 64
    # the same machine with a drafter that is never right: AR
    bad = SpeculationController(flat_cost())
    trained(bad, 1, [0], 64)
    assert bad.best(1, 64) == 0


def test_controller_shrinks_the_tree_as_the_batch_grows():
    cost = CostModel.from_function(lambda b, t: 0.02 + 0.0004 * b * t, GRID_B, GRID_T)
    ctrl = SpeculationController(cost)
    for B in (1, 16):
        trained(ctrl, B, [0, 1, 2, 3, 5, 8, 1, 0], 32)
    small, large = ctrl.best(1, 32), ctrl.best(16, 32)
    assert small > large and large <= 4


def test_controller_warmup_exploration_and_reset():
    cost = CostModel.from_function(lambda b, t: 0.02 * (1 + (t > 9) * t), GRID_B, GRID_T)
    ctrl = SpeculationController(cost, ControllerConfig(warmup_steps=2, explore_every=4,
                                                        warmup_cost_ratio=2.0, probe_until_seen=0))
    assert [ctrl.plan(1, 32) for _ in range(2)] == [8, 8]      # largest tree within 2x a plain step
    trained(ctrl, 1, [0], 8, draft_s=0.005)                    # a one-node step: 25 % dearer
    plans = [ctrl.plan(1, 32) for _ in range(20)]              # steps 3..22
    # one rung up at step 7; the probe did not change the choice, so the next comes 8 steps later
    assert [i + 3 for i, n in enumerate(plans) if n] == [7, 15] and set(plans) == {0, 1}
    ctrl.reset_acceptance()
    assert ctrl.plan(1, 32) == 8 and not ctrl.acc
    assert ctrl.plan(1, 0) == 0                                # nothing to draft: always AR


def test_a_size_the_choice_fell_below_is_probed_until_estimated_afresh():
    """A streak of rejections left size 2's increment at 0 (60 row-steps) and the choice fell to 1;
    then the workload changed and node 2 is always accepted. A probing episode weighs the stale
    zero as 5 row-steps against fresh probes and probes every 16 steps until 20 are in: the
    choice is back at 2 after two probes. Doubling after every probe (the rule before), each probe
    moves the estimate 5 % and comes twice as late as the last: still at 1 after 300 steps."""
    cost = CostModel.from_function(lambda b, t: 0.02 if t <= 2 else 0.0225, GRID_B, GRID_T)

    def run(cfg):
        ctrl = SpeculationController(cost, cfg)
        for _ in range(60):                                   # the streak: node 2 rejected
            ctrl.record(1, 2, [[1]], draft_s=0.005, verify_s=0.0225, tokens_per_row=3,
                        overhead_s=0.0)
        plans = []
        for _ in range(300):                                  # node 2 accepted from now on
            n = ctrl.plan(1, 32)
            plans.append(n)
            ctrl.record(1, n, [[1, 2][:n]], draft_s=0.005, verify_s=cost.verify_s(1, n + 1),
                        tokens_per_row=n + 1, overhead_s=0.0)
        return plans

    episodes = run(ControllerConfig(warmup_steps=0))
    assert episodes[:16] == [1] * 16 and episodes[16] == 2          # probe 1 (0 -> 1/6)
    assert min(episodes[40:]) >= 2                                   # probe 2 (-> 0.29 > 0.2)
    before = run(ControllerConfig(warmup_steps=0, probe_until_seen=0))
    assert before[-1] == 1 and before.count(2) <= 5


def test_probes_become_rare_where_speculation_never_pays():
    """Once a probing episode has established the size above, the interval doubles up to
    max_explore_every again: a workload that never rewards speculation pays ~nothing for probes."""
    cost = CostModel.from_function(lambda b, t: 0.02 * t, GRID_B, GRID_T)
    for B in (1, 16):
        ctrl = SpeculationController(cost, ControllerConfig(warmup_steps=0))
        ctrl.record(B, 1, [[]] * B, draft_s=0.005, verify_s=0.04, tokens_per_row=2,
                    overhead_s=0.0)
        probes = 0
        for _ in range(5000):
            n = ctrl.plan(B, 32)
            probes += n > 0
            ctrl.record(B, n, [[]] * B if n else [], draft_s=0.005 if n else 0.0,
                        verify_s=cost.verify_s(B, n + 1), tokens_per_row=n + 1, overhead_s=0.0)
        assert probes <= (40 if B == 1 else 20) and ctrl._interval == 512


def test_a_plain_choice_verifies_one_node_where_that_is_nearly_free():
    """Lookup drafting on a machine where one more token is ~free: a step that would be plain
    verifies one node (<= learn_margin dearer) and so keeps learning; where drafting or the extra
    token is dear, plain stays plain."""
    cost = CostModel.from_function(lambda b, t: 0.020 + 0.0001 * (t - 1), GRID_B, GRID_T)
    cheap = SpeculationController(cost, ControllerConfig(warmup_steps=0))
    trained(cheap, 1, [0], 8, draft_s=0.0003)                  # a dry spell: nothing accepted
    assert cheap.best(1, 32) == 0 and cheap.plan(1, 32) == 1
    trained(cheap, 1, [3, 4], 1, steps=40)                     # matches return: seen at once
    assert cheap.expected_accepted(1) > 0.8 and cheap.best(1, 32) >= 1
    dear = SpeculationController(cost, ControllerConfig(warmup_steps=0))
    trained(dear, 1, [0], 8, draft_s=0.004)                    # a drafter forward: 20 % of a step
    assert dear.plan(1, 32) == 0


def test_a_one_node_step_keeps_learning_where_its_acceptance_nearly_pays():
    """The learning step credits acceptance: a node that costs 12 % of a plain step, accepted on 1
    step in 6, loses ~4 % of a plain step's rate (under the speculation bar, but within
    ``learn_margin``), so the controller keeps verifying it and so keeps the estimate fresh;
    nothing accepted loses more than the margin, so the step stays plain."""
    cost = CostModel.from_function(lambda b, t: 0.020 + 0.0024 * (t - 1), GRID_B, GRID_T)
    near = SpeculationController(cost, ControllerConfig(warmup_steps=0))
    trained(near, 1, [1, 0, 0, 0, 0, 0], 1, steps=120, draft_s=0.0003)
    assert 0.1 < near.expected_accepted(1) < 0.25 and near.best(1, 8) == 0
    assert near.plan(1, 8) == 1
    dry = SpeculationController(cost, ControllerConfig(warmup_steps=0))
    trained(dry, 1, [0], 1, steps=120, draft_s=0.0003)
    assert dry.plan(1, 8) == 0
    off = SpeculationController(cost, ControllerConfig(warmup_steps=0, learn_margin=0.0))
    trained(off, 1, [1, 0, 0, 0, 0, 0], 1, steps=120, draft_s=0.0003)
    assert off.plan(1, 8) == 0
    with pytest.raises(ValueError):
        ControllerConfig(learn_margin=1.0)


def test_a_lookup_drafter_is_priced_by_the_nodes_it_proposes():
    """Prompt lookup proposes nothing in a dry spell, and such a step costs a plain forward plus the
    lookup, not a budget-n forward: the controller learns per budget how many nodes the forward
    carries. Same acceptance from a drafter that fills its budget every step: not worth it."""
    cost = CostModel.from_function(lambda b, t: 0.020 + 0.0018 * (t - 1), GRID_B, GRID_T)

    def fed(hit_width: int, miss_width: int) -> SpeculationController:
        ctrl = SpeculationController(cost, ControllerConfig(warmup_steps=0))
        for i in range(100):           # one step in 10 finds a 4-token match, all of it accepted
            hit = i % 10 == 0
            ctrl.record(1, 4, [[1, 2, 3, 4] if hit else []], draft_s=0.0003, verify_s=0.0,
                        tokens_per_row=1 + (hit_width if hit else miss_width), overhead_s=0.001)
        return ctrl

    lookup, full = fed(4, 0), fed(4, 4)
    assert lookup.acc == pytest.approx(full.acc) and 0.2 < lookup.expected_accepted(4) < 0.6
    assert lookup.expected_width(4) == pytest.approx(lookup.expected_accepted(4))
    assert full.expected_width(4) == pytest.approx(4.0) and full.width[2] == pytest.approx(2.0)
    assert lookup.best(1, 4) == 4 and full.best(1, 4) == 0
    assert lookup.plan(1, 4) == 4
    assert lookup.expected_width(6) == 6                        # never seen: its full width
    ctrl = SpeculationController(flat_cost(), ControllerConfig(alpha=1.0))
    ctrl.record(1, 8, [[1]], draft_s=0, verify_s=0, tokens_per_row=3, overhead_s=0)
    assert ctrl.width == {1: 1, 2: 2, 3: 2, 4: 2, 6: 2, 8: 2}   # min(verified, m)
    ctrl.reset_acceptance()
    assert not ctrl.width


def test_a_slow_first_drafting_time_does_not_keep_speculation_out():
    """The first lookup can take 150 ms (a memory-mapped N-gram model paged in): priced at that, no
    tree pays and the controller goes plain, where only probes refresh drafting time. The next
    observation at normal speed replaces the outlier (times only ever get noise added), so the first
    probe brings speculation back; ordinary variation is still averaged."""
    cost = CostModel.from_function(lambda b, t: 0.020 + 0.0018 * (t - 1), GRID_B, GRID_T)
    ctrl = SpeculationController(cost, ControllerConfig(warmup_steps=0, timing_alpha=0.1))
    ctrl.record(1, 4, [[1, 2]], draft_s=0.150, verify_s=0.0, tokens_per_row=5, overhead_s=0.001)
    assert ctrl.best(1, 4) == 0 and ctrl.plan(1, 4) == 0       # priced out by the outlier
    ctrl.record(1, 4, [[1, 2]], draft_s=0.0006, verify_s=0.0, tokens_per_row=5, overhead_s=0.001)
    assert ctrl.draft_s[(1, 4)] == pytest.approx(0.0006) and ctrl.best(1, 4) >= 2
    ctrl.record(1, 4, [[1, 2]], draft_s=0.0009, verify_s=0.0, tokens_per_row=5, overhead_s=0.001)
    assert ctrl.draft_s[(1, 4)] == pytest.approx(0.9 * 0.0006 + 0.1 * 0.0009)  # averaged


def test_drafting_time_is_priced_per_budget_and_by_its_mean():
    """DART skips its forward where the lookup paths fill the budget: a small budget drafts in
    0.5 ms, a bigger one in 5 ms, and one average would price both alike. Within a budget the time
    can be bimodal too (the paths fill it on some steps): the estimate is the mean, not the fast
    mode that replacing every "outlier" above twice an observation would follow."""
    ctrl = SpeculationController(flat_cost(), ControllerConfig(warmup_steps=0))
    for _ in range(20):
        for n, t in ((4, 0.0005), (12, 0.005)):
            ctrl.record(1, n, [[1]], draft_s=t, verify_s=0.0, tokens_per_row=n + 1,
                        overhead_s=0.001)
    assert ctrl.drafting_seconds(1, 4) == pytest.approx(0.0005)
    assert ctrl.drafting_seconds(1, 12) == pytest.approx(0.005)
    assert ctrl.drafting_seconds(1, 8) == pytest.approx(0.0005)      # a tie: the smaller budget
    assert ctrl.drafting_seconds(1, 24) == pytest.approx(0.005)      # the nearest budget
    assert ctrl.drafting_seconds(2, 12) == pytest.approx(0.010)      # another batch: scaled
    mixed = SpeculationController(flat_cost(), ControllerConfig(warmup_steps=0))
    for i in range(200):
        mixed.record(1, 8, [[1]], draft_s=0.0005 if i % 2 else 0.005, verify_s=0.0,
                     tokens_per_row=9, overhead_s=0.001)
    assert 0.002 < mixed.drafting_seconds(1, 8) < 0.0035              # the mean is 2.75 ms


def test_counterfactual_acceptance_per_tree_size():
    assert [accepted_within([1, 3, 7], m) for m in (1, 2, 3, 6, 7, 8)] == [1, 1, 2, 2, 3, 3]
    assert ladder_upto(10) == [0, 1, 2, 3, 4, 6, 8, 10] and ladder_upto(0) == [0]
    ctrl = SpeculationController(flat_cost(), ControllerConfig(alpha=1.0))
    ctrl.record(1, 8, [[1, 3, 7]], draft_s=0, verify_s=0, tokens_per_row=9, overhead_s=0)
    assert ctrl.acc == {1: 1, 2: 1, 3: 2, 4: 2, 6: 2, 8: 3}
    assert ctrl.expected_accepted(12) == 3 and ctrl.expected_accepted(0) == 0


def test_sizes_above_the_choice_are_priced_by_paired_increments():
    """A probe of 12 nodes on a hard prompt must not leave a stale, low acc(12) that outlives the
    workload: once the fresh sizes show high acceptance, bigger trees are priced as the fresh level
    plus the increments measured on the steps that verified both sizes."""
    ctrl = SpeculationController(flat_cost(), ControllerConfig(alpha=0.2))
    ctrl.record(1, 12, [[1, 2, 3, 4, 5, 6, 7, 8, 9]], draft_s=0, verify_s=0, tokens_per_row=13,
                overhead_s=0)                     # the probe: 9 of 12, 8 of them within the first 8
    trained(ctrl, 1, [0], 12, steps=40)         # a hard prompt: nothing accepted at any size
    # 9 - 8 = 1 at the probe, then 0: a plain mean over the first 1/alpha = 5 (1/5), then the EMA
    assert ctrl.gain[12] == pytest.approx(0.2 * 0.8 ** 36)
    trained(ctrl, 1, [8], 8, steps=60)          # an easy one, verified with 8 nodes only
    assert ctrl.fresh == 8 and ctrl.acc[12] < 0.01          # the stale level ...
    assert ctrl.expected_accepted(12) == pytest.approx(ctrl.acc[8] + ctrl.gain[12])  # ... unused
    assert ctrl.expected_accepted(12) >= ctrl.expected_accepted(8) > 7.9
    assert ctrl.expected_accepted(6) == ctrl.acc[6]         # fresh sizes: their own estimate
    assert ctrl.expected_accepted(64) <= 64


def test_tree_prefix_is_the_smaller_budget_tree():
    """Priority order: the first n nodes of a budget-N beam-search tree are the budget-n tree."""
    from dart_ray.engine.engine import _first_nodes_knobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 500, generator=g) * 3
    roots = torch.tensor([1, 2])
    full = DecodingConfig(draft_depth=6, top_k=6, beam_width=5, tree_budget=40)
    big = build_trees(roots, logits, full)
    for n in (1, 3, 4, 8, 17):
        cut = big.truncate(n)
        for knobs in (full.replace(tree_budget=n), _first_nodes_knobs(full, n)):
            small = build_trees(roots, logits, knobs)   # the engine's knobs: <= n beams and levels
            assert torch.equal(cut.tokens, small.tokens) and torch.equal(cut.parents, small.parents)
        cut.validate()


def test_small_tree_knobs_are_the_budget_n_knobs_built_once():
    """A step that verifies n < budget nodes drafts with budget-n knobs; the few sizes the
    controller picks reuse one config each instead of building a new one every step."""
    from dart_ray.engine.engine import _first_nodes_knobs

    d = DecodingConfig(draft_depth=6, tree_budget=40, beam_width=20)
    small = _first_nodes_knobs(d, 4)
    assert small == d.replace(draft_depth=4, tree_budget=4, beam_width=4)
    assert _first_nodes_knobs(DecodingConfig(draft_depth=6, tree_budget=40, beam_width=20),
                              4) is small
    assert _first_nodes_knobs(d, 12) == d.replace(tree_budget=12, beam_width=12)
    assert _first_nodes_knobs(d, 32) == d.replace(tree_budget=32)


# ---- exactness with the controller on ------------------------------------------------------------

class FlipController(ContextualController):
    """Alternates plain and speculative steps in a fixed pattern (exercises skip + catch-up)."""

    def __init__(self, pattern):
        super().__init__(flat_cost())
        self.pattern, self.steps = pattern, 0

    def plan(self, B, max_nodes, context=0):
        self.steps += 1
        return min(self.pattern[(self.steps - 1) % len(self.pattern)], max_nodes)


@pytest.fixture(scope="module")
def ar_out(tiny):
    eng = make_engine(tiny, "none", None, batch=1)
    return [eng.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("method", ["dart", "eagle", "medusa", "sps", "ngram"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_exact_with_adaptive_switching(tiny, tiny_baselines, ar_out, method, batch):
    drafter = {"dart": "random", "ngram": None}[method] if method in ("dart", "ngram") else \
        str(tiny_baselines[method])
    eng = make_engine(tiny, method, drafter, batch=batch)
    eng.controller = FlipController([24, 0, 0, 3, 1, 0, 24])
    # joins and leaves: different lengths, more requests than rows at batch 1
    lens = [24, 7, 15, 3]
    outs = eng.generate(PROMPTS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens])
    assert [o.token_ids for o in outs] == [a[:n] for a, n in zip(ar_out, lens, strict=True)]
    st = eng.stats()
    assert st.ar_steps > 0 and st.spec_row_steps > 0


class Recorder:
    """Wraps a drafter; records (committed length of row 0, tree tokens) of every proposal."""

    def __init__(self, inner):
        self.inner, self.trees = inner, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, view):
        tree = self.inner.propose(view)
        self.trees[view.lengths[0]] = tree.tokens[0, tree.valid[0]].tolist()
        return tree


class PauseUntil(ContextualController):
    """Plain steps from the 2nd step until row 0's committed length reaches ``resume_at``."""

    def __init__(self, engine, resume_at):
        super().__init__(flat_cost())
        self.engine, self.resume_at, self.steps = engine, resume_at, 0

    def plan(self, B, max_nodes, context=0):
        self.steps += 1
        if self.steps >= 2 and self.engine.cache.lengths[0] < self.resume_at:
            return 0
        return max_nodes


@pytest.mark.parametrize("method", ["dart", "eagle", "medusa", "sps"])
def test_drafter_catches_up_after_skipped_steps(tiny, tiny_baselines, method):
    """After plain AR steps the drafter catches up on the context it did not draft for (its KV from
    the taps those steps produced): from the resume point on it proposes exactly the trees -- and so
    accepts exactly as much -- as a drafter that drafted at every step."""
    drafter = "random" if method == "dart" else str(tiny_baselines[method])
    prompt, sp = PROMPTS[1], SamplingParams(max_new_tokens=30, ignore_eos=True)
    ref = make_engine(tiny, method, drafter, batch=1, adaptive=False)
    ref.drafter = Recorder(ref.drafter)
    want = ref.generate(prompt, sp)[0]
    lengths = sorted(ref.drafter.trees)
    resume = lengths[len(lengths) // 2]
    assert resume > lengths[1] + 3                                  # a real pause: several AR steps
    eng = make_engine(tiny, method, drafter, batch=1)
    eng.drafter = Recorder(eng.drafter)
    eng.controller = PauseUntil(eng, resume)
    got = eng.generate(prompt, sp)[0]
    assert got.token_ids == want.token_ids
    after = [n for n in lengths if n >= resume]
    assert after and all(eng.drafter.trees.get(n) == ref.drafter.trees[n] for n in after)
    assert eng.stats().ar_steps >= 3


# ---- lazy LM head --------------------------------------------------------------------------------

def bushy_tree(B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        toks = torch.randint(0, 50, (12,), generator=g).tolist()
        pars = [0, 0, 1, 1, 2, 0, 3, 5, 5, 7, 4, 4]
        rows.append((toks, pars))
    return pack_trees(torch.tensor([5, 6, 7][:B]), rows)


def test_lazy_logits_give_identical_tokens_and_skip_leaves(monkeypatch):
    import dart_ray.verify.logits as logits_mod

    monkeypatch.setattr(logits_mod, "EAGER_HEAD_ROWS", 0)     # internal nodes only (fill: below)
    tree = bushy_tree()
    B, T = tree.tokens.shape
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, 16, generator=g)
    W = torch.randn(50, 16, generator=g)
    head = lambda h: (h @ W.T) * 3                                     # noqa: E731
    dense = head(hidden)
    # make some paths correct so acceptance goes deep (into leaves)
    for _ in range(3):
        pred = dense.argmax(-1)
        tree.tokens[:, 1:] = torch.where(torch.rand(B, T - 1, generator=g) < 0.7,
                                         pred.gather(1, tree.parents[:, 1:].clamp(min=0)),
                                         tree.tokens[:, 1:])
    lazy = NodeLogits.lazy(tree, hidden, head)
    assert lazy.head_rows == int(internal_nodes(tree).sum()) < B * T
    a, b = greedy_accept(tree, dense), greedy_accept(tree, lazy)
    assert torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)
    assert int(a.num_accepted.max()) >= 2
    for seed in range(5):
        rands = [RequestRandom(seed * 10 + i) for i in range(B)]
        s1 = sample_accept(tree, dense, 0.7, 0, 0.9, rands)
        s2 = sample_accept(tree, NodeLogits.lazy(tree, hidden, head), 0.7, 0, 0.9, rands)
        assert torch.equal(s1.path, s2.path) and torch.equal(s1.bonus, s2.bonus)
    mixed = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    m1 = accept(tree, dense, mixed, [None, RequestRandom(3), None])
    m2 = accept(tree, NodeLogits.lazy(tree, hidden, head), mixed, [None, RequestRandom(3), None])
    assert torch.equal(m1.path, m2.path) and torch.equal(m1.bonus, m2.bonus)


def test_lazy_logits_take_chain_leaves_in_the_first_call():
    """Chains (one leaf per row): the leaf joins the eager head call, so a chain accepted to its
    end needs no second call; the tokens are those of the dense head."""
    B, T, V = 2, 4, 50
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, 16, generator=g)
    W = torch.randn(V, 16, generator=g)
    calls = []

    def head(h):
        calls.append(h.shape[0])
        return (h @ W.T) * 3

    dense = (hidden @ W.T) * 3
    pred = dense.argmax(-1)                                              # [B, T]
    toks = torch.zeros(B, T, dtype=torch.long)
    for i in range(1, T):                       # each node = its parent's argmax: all accepted
        toks[:, i] = pred[:, i - 1]
    chain = TokenTree(toks, torch.tensor([[-1, 0, 1, 2]] * B), torch.arange(T).expand(B, T),
                      torch.ones(B, T, dtype=torch.bool))
    lazy = NodeLogits.lazy(chain, hidden, head)
    assert calls == [B * T] and lazy.head_rows == B * T
    a, b = greedy_accept(chain, dense), greedy_accept(chain, lazy)
    assert torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)
    assert a.num_accepted.tolist() == [T - 1] * B and calls == [B * T]  # no second call


def test_lazy_logits_fill_the_first_call_with_the_best_leaves(monkeypatch):
    """Below EAGER_HEAD_ROWS rows the eager call takes leaves too, the first ones in node (priority)
    order, round-robin over the rows; tokens stay those of the dense head. 0 = internal nodes only
    (and chains' leaves)."""
    import dart_ray.verify.logits as logits_mod

    g = torch.Generator().manual_seed(4)
    W = torch.randn(50, 16, generator=g)
    calls = []

    def head(h):
        calls.append(h.shape[0])
        return (h @ W.T) * 3

    one = bushy_tree(B=1)                    # 7 internal nodes, leaves 6, 8, 9, 10, 11, 12
    hidden = torch.randn(1, one.tokens.shape[1], 16, generator=g)
    monkeypatch.setattr(logits_mod, "EAGER_HEAD_ROWS", 0)
    assert NodeLogits.lazy(one, hidden, head).head_rows == 7 and calls == [7]
    monkeypatch.setattr(logits_mod, "EAGER_HEAD_ROWS", 8)
    calls.clear()
    lazy = NodeLogits.lazy(one, hidden, head)
    assert calls == [8]
    assert lazy._slot[0, 6] >= 0 and bool((lazy._slot[0, 8:] < 0).all())   # the first leaf only
    dense = head(hidden)
    for target in (6, 11):                        # accept the computed leaf, then a missing one
        tree = bushy_tree(B=1)
        pred = dense.argmax(-1)[0]
        node = target
        while node:                               # make the path root -> target correct
            par = int(tree.parents[0, node])
            tree.tokens[0, node] = pred[par]
            node = par
        lz = NodeLogits.lazy(tree, hidden, head)
        a, b = greedy_accept(tree, dense), greedy_accept(tree, lz)
        assert torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)
        assert int(a.path[0, a.num_accepted[0]]) == target
        assert lz.head_rows == (8 if target == 6 else 9)      # a second call only for leaf 11
    # two small trees: 3 internal nodes + 4 leaves each; 6 internal rows leave room for 2 leaves,
    # one per row (each row's first)
    small = pack_trees(torch.tensor([5, 6]), [([1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 2, 1])] * 2)
    inner = internal_nodes(small)
    assert int(inner.sum()) == 6
    lz = NodeLogits.lazy(small, torch.randn(2, 7, 16, generator=g), head)
    assert lz.head_rows == 8
    picked = (lz._slot >= 0) & ~inner
    assert picked.sum(1).tolist() == [1, 1]
    first_leaf = (small.valid & ~inner).long().argmax(1)
    assert picked[torch.arange(2), first_leaf].all()
    monkeypatch.setattr(logits_mod, "EAGER_HEAD_ROWS", 9)       # room for 3: rank-major order
    lz = NodeLogits.lazy(small, torch.randn(2, 7, 16, generator=g), head)
    picked = (lz._slot >= 0) & ~inner
    assert picked.sum(1).tolist() == [2, 1]         # both rows' first leaves, then row 0's second
    monkeypatch.setattr(logits_mod, "EAGER_HEAD_ROWS", 16)      # every leaf fits: all eager
    assert NodeLogits.lazy(small, torch.randn(2, 7, 16, generator=g), head).head_rows == 14
    # sampled acceptance over a partly filled eager set: the dense head's result
    monkeypatch.setattr(logits_mod, "EAGER_HEAD_ROWS", 8)
    tree3 = bushy_tree(B=1)
    for seed in range(5):
        s1 = sample_accept(tree3, dense, 0.7, 0, 0.9, [RequestRandom(seed)])
        s2 = sample_accept(tree3, NodeLogits.lazy(tree3, hidden, head), 0.7, 0, 0.9,
                           [RequestRandom(seed)])
        assert torch.equal(s1.path, s2.path) and torch.equal(s1.bonus, s2.bonus)


def test_engine_runs_the_head_on_fewer_rows_than_nodes(tiny, ar_out):
    eng = make_engine(tiny, "dart", "random", batch=2, adaptive=False)
    assert [o.token_ids for o in eng.generate(PROMPTS[:2], GREEDY)] == ar_out[:2]
    st = eng.stats()
    assert st.head_rows < st.draft_tokens + st.row_steps            # nodes + roots verified


# ---- dtype auto ----------------------------------------------------------------------------------

def test_dtype_auto_follows_capability_and_measurement(tmp_path, monkeypatch):
    from dart_ray import hardware

    monkeypatch.setenv("DART_RAY_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "bf16_supported", lambda device: False)
    choice = hardware.resolve_dtype("auto", "cpu")
    assert choice.dtype == "fp32" and "no native bf16" in choice.reason
    assert hardware.resolve_dtype("bf16", "cpu").dtype == "bf16"   # asked for: no second-guessing
    monkeypatch.setattr(hardware, "bf16_supported", lambda device: True)
    fast = {"bf16_1": 1.0, "bf16_64": 2.0, "fp32_1": 1.5, "fp32_64": 4.0}
    monkeypatch.setattr(hardware, "measure_bf16_vs_fp32", lambda device: dict(fast))
    assert hardware.resolve_dtype("auto", "cpu").dtype == "bf16"
    # emulated bf16 (the AVX2 case): supported on paper, 7x slower at tree sizes -> fp32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")               # another fingerprint, not cached
    monkeypatch.setattr(hardware, "measure_bf16_vs_fp32",
                        lambda device: {"bf16_1": 0.12, "bf16_64": 6.9, "fp32_1": 0.14,
                                        "fp32_64": 0.97})
    choice = hardware.resolve_dtype("auto", "cpu")
    assert choice.dtype == "fp32" and "slower" in choice.reason


def test_cached_machine_decisions_follow_every_isa_restriction_and_survive_bad_files(
        tmp_path, monkeypatch):
    """oneDNN honours DNNL_MAX_CPU_ISA too: it was not in the fingerprint, so a dtype decision (and
    packing, cost tables) cached without it was reused under it, and the other way round. A cache
    file of the wrong shape crashed the engine start; a 0 s cost cell made verifying free."""
    from dart_ray import hardware
    from dart_ray.engine.cost import CostModel

    monkeypatch.setenv("DART_RAY_CACHE", str(tmp_path))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    plain = hardware.Fingerprint.current("cpu", "fp32").key()
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE")
    assert hardware.Fingerprint.current("cpu", "fp32").key() != plain
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")

    assert not hardware.bf16_supported("cuda") or torch.cuda.is_available()  # no GPU: no crash
    monkeypatch.setattr(hardware, "bf16_supported", lambda device: True)
    calls = []
    monkeypatch.setattr(hardware, "measure_bf16_vs_fp32", lambda device: calls.append(1) or
                        {"bf16_1": 1.0, "bf16_64": 2.0, "fp32_1": 1.5, "fp32_64": 4.0})
    name = f"dtype-v{hardware.DTYPE_PROBE_VERSION}-{hardware.Fingerprint.current('cpu').key()}.json"
    for bad in ("123", '"x"', '{"bf16_1": 1, "bf16_64": 2, "fp32_1": 0, "fp32_64": 4}',
                '{"bf16_1": "a", "bf16_64": 2, "fp32_1": 1, "fp32_64": 4}'):
        (hardware.hardware_cache_dir()).mkdir(parents=True, exist_ok=True)
        (hardware.hardware_cache_dir() / name).write_text(bad)
        assert hardware.resolve_dtype("auto", "cpu").dtype == "bf16", bad   # measured anew
    assert len(calls) == 4
    with pytest.raises(ValueError, match="positive seconds"):
        CostModel([1], [1], {(1, 1): 0.0})


def test_the_allocator_reexec_reads_an_abbreviated_device_flag():
    """argparse takes ``--dev cuda`` for ``--device cuda``: the re-exec check read only the full
    spelling and put a GPU command under jemalloc."""
    from dart_ray.cli import _device_arg

    assert _device_arg(["generate", "hi", "--dev", "cuda"]) == "cuda"
    assert _device_arg(["generate", "hi", "--devic=cuda:1"]) == "cuda:1"
    assert _device_arg(["bench", "--decoding", "{}", "--device", "cpu"]) == "cpu"
    assert _device_arg(["generate", "--de", "x"]) == ""          # ambiguous with --decoding


def test_fingerprint_round_trip_and_differences():
    from dart_ray.hardware import Fingerprint

    fp = Fingerprint.current("cpu", "fp32", "m")
    assert Fingerprint.from_dict(fp.to_dict()) == fp and len(fp.key()) == 16
    other = Fingerprint.from_dict({**fp.to_dict(), "cpu": "Other CPU", "threads": fp.threads + 1})
    diffs = fp.differences(other)
    assert len(diffs) == 2 and any("Other CPU" in d for d in diffs)
    with pytest.raises(ValueError, match="missing"):
        Fingerprint.from_dict({"cpu": "x"})


def test_fingerprint_tells_cpu_generations_with_one_model_string_apart():
    """Two KVM guests, Zen 4 and Zen 5, both read "AMD EPYC" with the same flags: the family/model
    numbers split their cached measurements; a record made before the field existed still loads
    and is not said to differ in it."""
    from dart_ray import hardware
    from dart_ray.hardware import Fingerprint

    zen5 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: avx2 avx512f avx512_bf16\n\n"
            "processor\t: 1\ncpu family\t: 99\n")
    assert hardware.cpu_id(zen5) == "family 26 model 2"
    arm = "processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert hardware.cpu_id(arm) == "implementer 0x41 part 0xd40"
    assert hardware.cpu_id("processor\t: 0\nmodel name\t: x\n") == ""
    zen5_fp = Fingerprint("AMD EPYC", "AMD EPYC", ("avx2",), 2, "2.13.0", "bf16", "m",
                          cpu_id="family 26 model 2")
    zen4_fp = dataclasses.replace(zen5_fp, cpu_id="family 25 model 17")
    assert zen5_fp.key() != zen4_fp.key() and len(zen5_fp.differences(zen4_fp)) == 1
    assert "(family 26 model 2)" in zen5_fp.summary()
    old = {k: v for k, v in zen4_fp.to_dict().items() if k != "cpu_id"}     # an older record
    assert Fingerprint.from_dict(old).cpu_id == "" and zen5_fp.differences(
        Fingerprint.from_dict(old)) == []


# ---- usage agrees with the text ------------------------------------------------------------------

def test_stop_string_usage_counts_text_plus_stop(tiny):
    """Tokens accepted in the same step after a stop string are not output: the ids returned are
    exactly those of text + stop (what the tokenizer counts)."""
    eng = make_engine(tiny, "none", None, batch=1)
    full = eng.generate(PROMPTS[3], GREEDY)[0]
    ids = full.token_ids
    tok = tiny.tokenizer
    # a stop string that ends inside the output, several tokens before its end
    for k in (3, 6):
        prefix = tok.decode(ids[:k], skip_special_tokens=True)
        stop = prefix[-2:] if len(prefix) >= 2 else prefix
        if not stop.strip():
            continue
        for eng2 in (make_engine(tiny, "dart", "random", batch=1, adaptive=False), eng):
            out = eng2.generate(PROMPTS[3],
                                SamplingParams(max_new_tokens=24, stop=(stop,), ignore_eos=True))[0]
            cut = full.text.find(stop)
            assert out.finish_reason == "stop" and out.text == full.text[:cut]
            n = len(out.token_ids)
            text = tok.decode(out.token_ids, skip_special_tokens=True)
            assert text.startswith(full.text[:cut] + stop)
            assert len(tok.decode(out.token_ids[:n - 1],
                                  skip_special_tokens=True)) < cut + len(stop)


def test_controller_biases_unknowns_toward_plain_steps():
    """Unknown plain-step overhead is taken as 0 (so plain decoding is tried and then measured), and
    the drafting time of a step that followed plain steps (it includes the drafter's catch-up) does
    not count as drafting cost."""
    ctrl = SpeculationController(flat_cost(), ControllerConfig(alpha=1.0, timing_alpha=1.0))
    ctrl.record(1, 4, [[1]], draft_s=0.002, verify_s=0.02, tokens_per_row=5, overhead_s=0.01)
    assert ctrl.step_seconds(1, 0) == pytest.approx(0.02)                 # no AR overhead known: 0
    assert ctrl.step_seconds(1, 4) == pytest.approx(0.002 + 0.02 + 0.01)
    ctrl.record(1, 0, [], draft_s=0.0, verify_s=0.02, tokens_per_row=1, overhead_s=0.003)
    # catch-up
    ctrl.record(1, 4, [[1]], draft_s=0.5, verify_s=0.02, tokens_per_row=5, overhead_s=0.01)
    assert ctrl.draft_s[(1, 4)] == pytest.approx(0.002)
    ctrl.record(1, 4, [[1]], draft_s=0.003, verify_s=0.02, tokens_per_row=5, overhead_s=0.01)
    assert ctrl.draft_s[(1, 4)] == pytest.approx(0.003)


def test_stop_trim_keeps_a_split_utf8_character(tiny):
    """A stop string whose last character spans several byte-level tokens keeps all of them."""
    from dart_ray.engine.detok import RequestText

    tok = tiny.tokenizer
    stop = "\U0001F642"                                              # an emoji: several byte tokens
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    ids = tok.encode("ok " + stop + " then more words", add_special_tokens=False)
    kept, text, stopped = RequestText(tok, (stop,)).push(ids, False)  # one step brought them all
    keep = len(kept)
    assert stopped and kept == ids[:keep] and text == "ok "
    assert stop in tok.decode(ids[:keep], skip_special_tokens=True)
    assert stop not in tok.decode(ids[:keep - 1], skip_special_tokens=True)


def test_a_catch_up_step_teaches_acceptance_but_not_drafting_time():
    """A drafter forward that also took a new prompt (5-10 ms) is not a step's drafting cost: the
    step's acceptance is learned, its drafting time is not; the next ordinary step's time is."""
    ctrl = ContextualController(flat_cost(), ControllerConfig(warmup_steps=0))
    ctrl.record(1, 4, [[1, 2]], draft_s=0.009, verify_s=0.0, tokens_per_row=5, overhead_s=0.001,
                catch_up=True)
    assert ctrl[0].draft_s == {} and ctrl[0].acc[4] == pytest.approx(2.0)
    ctrl.record(1, 4, [[1]], draft_s=0.002, verify_s=0.0, tokens_per_row=5, overhead_s=0.001)
    assert ctrl[0].draft_s == {(1, 4): pytest.approx(0.002)}
