"""Drafting contexts and hindsight acceptance: the adaptive controller plans a step from the
estimates of its context (prompt lookup: the suffix match length) and learns what bigger trees
than the verified cut would have accepted from the text generated afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import COST_GRID_B, COST_GRID_T, MIXED_PROMPTS, flat_cost

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams
from dart_ray.drafters import BatchView, make_drafter
from dart_ray.drafters.ngram import NGramDrafter, ViewLookups, lookup_match
from dart_ray.engine.controller import ContextualController, ControllerConfig, SpeculationController
from dart_ray.engine.cost import CostModel
from dart_ray.engine.hindsight import Hindsight
from dart_ray.models import load_target
from dart_ray.tree import pack_trees


def view(rows: list[list[int]], roots: list[int], **knobs) -> BatchView:
    tokens = np.zeros((4, 64), dtype=np.int64)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    return BatchView(roots=torch.tensor(roots), lengths=[len(r) for r in rows], tokens=tokens,
                     decoding=DecodingConfig(**knobs))


# ---- hindsight walks -----------------------------------------------------------------------------

# one row: root 5, a chain 10 11 12 13 (nodes 1-4) and a branch 20 under node 1 (node 5)
CHAIN = ([10, 11, 12, 13, 20], [0, 1, 2, 3, 1])


def begin(h, bonus, accepted, n_used=2, known=5, trees=(CHAIN,), ids=("r",)):
    full = pack_trees(torch.tensor([5] * len(trees)), list(trees))
    return h.begin(7, known, n_used, full, [list(a) for a in accepted], bonus, list(ids))


def test_a_path_past_the_cut_goes_on_with_the_next_tokens():
    h = Hindsight()
    step = begin(h, [12], [[1, 2]])          # 10 11 accepted within the cut, bonus 12 = node 3
    assert not step.done and step.paths == [None] and h.running("r")
    assert h.feed("r", [13, 99]) == [step]   # 13 = node 4 (a leaf): the path ends
    assert not h.running("r")
    assert step.done and step.paths == [[1, 2, 3, 4]] and step.context == 7 and step.known == 5
    assert h.feed("r", [1]) == []            # nothing pending any more


def test_a_path_that_stops_at_the_cut_is_known_at_once():
    h = Hindsight()
    assert begin(h, [99], [[1, 2]]).paths == [[1, 2]]          # the bonus is no child: done
    assert begin(h, [13], [[1, 2, 3]], n_used=3).paths == [[1, 2, 3, 4]]   # a leaf child: done
    assert begin(h, [12], [[1, 2]], known=2).paths == [[1, 2]]   # nothing known past the cut
    assert begin(h, [12], [[1, 2]], known=3).paths == [[1, 2, 3]]  # node 4 lies past known
    assert h.feed("r", [13]) == []


def test_a_request_that_leaves_ends_its_walks_where_they_are():
    h = Hindsight()
    step = begin(h, [11, 99], [[1], []], n_used=1, trees=(CHAIN, CHAIN), ids=("a", "b"))
    assert step.paths == [None, []] and not step.done
    assert h.feed("a", [12]) == [] and not step.done            # node 3, still inner
    assert h.end("a") == [step] and step.paths == [[1, 2, 3], []]
    assert h.end("a") == [] and h.end("b") == []


# ---- the controller ------------------------------------------------------------------------------

def test_the_controller_learns_budgets_up_to_known_and_widths_at_once():
    ctrl = SpeculationController(flat_cost(), ControllerConfig(alpha=1.0))
    ctrl.record(1, 2, None, draft_s=0, verify_s=0, tokens_per_row=3, overhead_s=0, known=8,
                full_width=6)
    assert ctrl.acc == {} and ctrl.width == {1: 1, 2: 2, 3: 3, 4: 4, 6: 6, 8: 6}
    ctrl.learn([[1, 2, 3, 4]], 8)
    assert ctrl.acc == {1: 1, 2: 2, 3: 3, 4: 4, 6: 4, 8: 4} and ctrl.fresh == 8
    # what only a probe would have shown before: with 8 nodes it accepts twice as much
    assert ctrl.expected_accepted(8) == 2 * ctrl.expected_accepted(2)


def test_contexts_keep_their_own_estimates():
    """Copy runs (context 3) accept the whole chain, steps without a match (0) nothing: one average
    would price both alike; per context, 3 verifies a big tree and 0 goes plain."""
    cost = CostModel.from_function(lambda b, t: 0.020 + 0.0018 * (t - 1), COST_GRID_B, COST_GRID_T)
    bank = ContextualController(cost, ControllerConfig(warmup_steps=0))
    for i in range(60):
        ctx = 3 if i % 2 else 0
        n = bank.plan(1, 16, ctx)
        # context 3: a 16-token lookup path accepted whole, the part past the cut in hindsight
        paths = [list(range(1, 17))] if ctx == 3 else [[]]
        bank.record(1, n, paths if n else [], draft_s=0.0005, verify_s=0.0,
                    tokens_per_row=n + 1, overhead_s=0.001, context=ctx,
                    known=16 if ctx == 3 and n else None)
    assert set(bank.by_context) == {0, 3}
    assert bank.by_context[3].best(1, 16) == 16 and bank.by_context[0].best(1, 16) == 0
    assert bank.plan(1, 16, 3) == 16 and bank.last_choice == 16 and bank.last_context == 3
    bank.reset_acceptance()
    assert all(not c.acc for c in bank.by_context.values())


# ---- drafters' contexts --------------------------------------------------------------------------

def test_lookup_contexts_are_the_shortest_suffix_match_over_the_rows():
    seq = np.array([1, 2, 3, 9, 1, 2, 3])
    assert lookup_match(seq, 2, 4) == ([[9, 1]], 3)
    assert lookup_match(np.array([1, 2, 3]), 2, 4) == ([], 0)
    d = NGramDrafter()
    assert d.context(view([[1, 2, 3, 9, 1, 2]], [3], draft_depth=2)) == 3
    assert d.context(view([[1, 2, 3, 9, 1, 2], [4, 8, 4, 6]], [3, 4], draft_depth=2)) == 1
    assert d.context(view([[1, 2, 3, 9, 1, 2], [5, 6]], [3, 7], draft_depth=2)) == 0


def test_a_step_looks_up_once_and_other_knobs_search_again():
    v = view([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2]], [3], draft_depth=3)
    cache = ViewLookups()
    first = cache.get(v, 3, 4, 3, 1)
    assert first == [([[7, 5, 1], [9, 1, 2]], 3)]
    assert cache.get(v, 3, 4, 3, 1)[0] is first[0]                # the same view: no new search
    assert cache.get(v, 1, 4, 3, 1) == [([[7], [9]], 3)]           # another depth: a new search
    other = view([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2]], [3], draft_depth=3)
    assert cache.get(other, 3, 4, 3, 1)[0] is not first[0]        # another step: searched again


def test_the_context_stops_at_the_first_row_without_a_match(monkeypatch):
    """A large batch's context is 0 as soon as one row has no match (the step then usually runs
    plain): the rows after it are searched only if ``propose`` needs them, and none twice."""
    import dart_ray.drafters.ngram as ngram_mod

    calls = []
    real = ngram_mod.lookup_match
    monkeypatch.setattr(ngram_mod, "lookup_match",
                        lambda seq, *a: calls.append(list(seq)) or real(seq, *a))
    d = NGramDrafter()
    v = view([[1, 2, 3, 9, 1, 2], [5, 6], [1, 2, 3, 9, 1, 2]], [3, 7, 3], draft_depth=2)
    assert d.context(v) == 0 and len(calls) == 2        # row 1 has none: row 2 not searched
    assert [k for _, k in d._lookups(v)] == [3, 0, 3] and len(calls) == 3
    w = view([[1, 2, 3, 9, 1, 2], [4, 8, 4, 6]], [3, 4], draft_depth=2)
    assert d.context(w) == 1 and len(calls) == 5                   # every row matched: all searched
    assert d._lookups(w)[0][1] == 3 and len(calls) == 5            # ... once


def test_ngram_returns_the_whole_trie_of_the_configured_knobs_under_a_cut(monkeypatch):
    """Cut to 2 nodes (budget-2 knobs: 2 beams, depth 2), `ngram` still returns the trie of the
    configured knobs, all three continuations of [4, 6, 8] at depth 3, found by one search that
    ``context`` and ``propose`` share, and says it is exact up to its budget."""
    import dart_ray.drafters.ngram as ngram_mod
    from dart_ray.engine.engine import _first_nodes_knobs

    calls = []
    real = ngram_mod.lookup_match
    monkeypatch.setattr(ngram_mod, "lookup_match", lambda *a, **k: calls.append(a) or real(*a, **k))
    d = NGramDrafter()
    v = view([[4, 6, 8, 1, 4, 6, 8, 2, 4, 6, 8, 3, 4, 6]], [8], draft_depth=3, beam_width=20,
             tree_budget=12)
    assert d.context(v) == 3
    v.full_decoding, v.decoding, v.max_nodes = v.decoding, _first_nodes_knobs(v.decoding, 2), 2
    tree = d.propose(v)
    assert tree.tokens.tolist() == [[8, 3, 4, 6, 2, 4, 6, 1, 4, 6]]
    assert v.exact_nodes == [12] and len(calls) == 1


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=512)


class TwoNodes(ContextualController):
    """Verifies at most two nodes every step, learning as the engine's controller does."""

    def plan(self, B, max_nodes, context=0):
        self.last_context = context
        return min(2, max_nodes)


@pytest.mark.parametrize("method", ["ngram", "dart"])
@pytest.mark.parametrize("batch", [1, 3])
def test_engine_learns_bigger_trees_than_it_verifies_and_stays_exact(tiny, method, batch):
    """With two nodes verified per step, the prompt-lookup steps still teach the controller what
    bigger budgets accept (their trie is prefix-exact), and greedy output is the plain one."""
    decoding = DecodingConfig(tree_budget=24, top_k=8, beam_width=6, draft_depth=8)
    engines = []
    for m in ("none", method):
        cfg = EngineConfig(method=m, drafter="random" if m == "dart" else None, ngram="none",
                           dtype="fp32", max_batch_size=batch, max_seq_len=512, decoding=decoding)
        engines.append(Engine(tiny, make_drafter(cfg, tiny), cfg, cost_model=flat_cost()))
    ar, eng = engines
    eng.controller = TwoNodes(flat_cost())
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in ar.generate(MIXED_PROMPTS, sp)]
    got = [o.token_ids for o in eng.generate(MIXED_PROMPTS, sp)]
    assert got == want
    learned = {m for c in eng.controller.by_context.values() for m in c.acc}
    assert max(learned) > 2                                       # never verified, learned
    if batch == 1:        # (a batch's context is its weakest row's: rarely a match here)
        lookups = [c for k, c in eng.controller.by_context.items() if k[0] > 0]
        assert lookups and any(c.acc.get(8, 0) > c.acc[2] for c in lookups)
    assert not eng.hindsight._by_request                          # every walk ended
