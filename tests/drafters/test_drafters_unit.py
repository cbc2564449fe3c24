"""Each drafter class on its own (no engine): the trees it proposes for a hand-made batch -- their
shapes, priority order (parents first; the tree of budget n is the first n nodes of a bigger one),
``tree_budget`` / ``draft_depth`` / ``top_k`` respected -- and its per-row state. Networks are
random (untrained) on the tiny random Llama target; the N-gram drafter and EAGLE's node selection
are checked on hand-made inputs with exact expected trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dart_ray.config import DecodingConfig, EngineConfig, SamplingParams
from dart_ray.drafters import BatchView, NoDrafter, make_drafter
from dart_ray.drafters.eagle import EagleDrafter
from dart_ray.drafters.ngram import NGramDrafter, lookup_continuations
from dart_ray.models import load_target
from dart_ray.training.objectives import sps_train_forward
from dart_ray.tree import TokenTree
from dart_ray.verify import RequestRandom

B_MAX, S_MAX = 4, 64
KNOBS = {"draft_depth": 4, "top_k": 5, "beam_width": 4, "tree_budget": 12, "lookup_paths": 0}


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=512)


def build(method: str, target, drafter: str | None = None):
    cfg = EngineConfig(method=method, drafter=drafter, ngram="none", dtype="fp32")
    d = make_drafter(cfg, target)
    d.allocate(B_MAX, S_MAX)
    return d


def view(rows: list[list[int]], roots: list[int], params=None, **knobs) -> BatchView:
    """A batch of committed token rows and their next roots (rows 0..len(rows)-1)."""
    tokens = np.zeros((B_MAX, S_MAX), dtype=np.int64)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    return BatchView(roots=torch.tensor(roots), lengths=[len(r) for r in rows], tokens=tokens,
                     decoding=DecodingConfig(**{**KNOBS, **knobs}), params=params)


def prefill(d, rows: list[list[int]], roots: list[int], hidden: int, seed: int = 0) -> None:
    """What the engine hands a drafter after the target prefilled ``rows``: random taps at every
    prompt position and the token after each position (the prompt shifted, then the root)."""
    g = torch.Generator().manual_seed(seed)
    T = max(len(r) for r in rows)
    taps = torch.randn(len(rows), T, max(len(d.taps), 1) * hidden, generator=g)
    nxt = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        nxt[b, :len(r)] = torch.tensor(r[1:] + [roots[b]])
    d.prefill(slice(0, len(rows)), [len(r) for r in rows], taps, nxt)


def check_tree(tree: TokenTree, roots: list[int], budget: int, depth: int,
               top_k: int | None = None, min_nodes: int = 1) -> None:
    """A well-formed tree per row: root first, parents before children, budget and depth kept."""
    tree.validate()
    assert tree.tokens[:, 0].tolist() == roots
    assert tree.parents[:, 0].tolist() == [-1] * len(roots)
    for b in range(len(roots)):
        v = tree.valid[b]
        n = int(v.sum()) - 1
        assert min_nodes <= n <= budget
        assert bool(v[:n + 1].all()) and not bool(v[n + 1:].any())    # valid nodes are a prefix
        par = tree.parents[b, 1:n + 1].tolist()
        assert all(0 <= p < i for i, p in enumerate(par, start=1))   # parents first
        assert int(tree.depths[b, :n + 1].max()) <= depth
        if top_k is not None and par:                                  # children per node
            assert max(np.bincount(par)) <= top_k


def first_nodes(tree: TokenTree, n: int) -> tuple[list, list]:
    return tree.tokens[:, :n + 1].tolist(), tree.parents[:, :n + 1].tolist()


ROWS = [[11, 12, 13, 14, 15, 11, 12], [7, 8, 9]]
ROOTS = [13, 10]


# ---- none ----------------------------------------------------------------------------------------

def test_no_drafter_proposes_the_root_only(tiny):
    d = build("none", tiny)
    assert isinstance(d, NoDrafter) and d.name == "none" and d.taps == ()
    assert d.max_tree_nodes(DecodingConfig(tree_budget=60)) == 0
    tree = d.propose(view(ROWS, ROOTS))
    assert tree.tokens.tolist() == [[13], [10]] and tree.parents.tolist() == [[-1], [-1]]
    assert tree.depths.tolist() == [[0], [0]] and tree.valid.all()


# ---- N-gram (prompt lookup) ----------------------------------------------------------------------

def test_lookup_prefers_the_longest_suffix_and_the_most_recent_match():
    seq = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # suffix [2, 3] (no earlier [5, 2, 3]) occurred at 1 and 5: the later one first
    assert lookup_continuations(seq, 2, 4) == [[7, 5], [9, 1]]
    assert lookup_continuations(seq, 2, 1) == [[7, 5]]                   # max_cands
    assert lookup_continuations(seq, 3, 4, min_match=3) == []            # [5, 2, 3] is new
    seq = np.array([4, 8, 4, 6, 4])                                       # only the 1-token suffix
    assert lookup_continuations(seq, 2, 4) == [[6, 4], [8, 4]]
    assert lookup_continuations(np.array([4, 4, 4]), 5, 4) == [[4]]      # cut at the text's end
    seq = np.array([7, 1, 7, 1, 7])                                       # both 7s precede a 1
    assert lookup_continuations(seq, 1, 4, max_match=1) == [[1]]          # duplicates dropped


def test_ngram_drafter_merges_lookups_into_a_trie_in_priority_order():
    d = NGramDrafter()
    rows = [[1, 2, 3, 9, 1, 2, 3, 7, 5, 2], [5, 6]]
    v = view(rows, [3, 7], draft_depth=2, tree_budget=12)
    assert d.max_tree_nodes(v.decoding) == 12
    tree = d.propose(v)
    check_tree(tree, [3, 7], budget=12, depth=2, min_nodes=0)
    # row 0: [7, 5] then [9, 1]; row 1: no match and no corpus model -> root only
    assert tree.tokens.tolist() == [[3, 7, 5, 9, 1], [7, 0, 0, 0, 0]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3], [-1, 0, 0, 0, 0]]
    assert tree.valid.tolist() == [[True] * 5, [True, False, False, False, False]]
    # [4, 6] was followed by 8 2 4, and before that by 8 1 4: a shared prefix is one node
    rows = [[4, 6, 8, 1, 4, 6, 8, 2, 4]]
    big = d.propose(view(rows, [6], draft_depth=3))
    assert big.tokens.tolist() == [[6, 8, 2, 4, 1, 4]]
    assert big.parents.tolist() == [[-1, 0, 1, 2, 1, 4]]
    small = d.propose(view(rows, [6], draft_depth=3, tree_budget=4))   # the trie cut at 4 nodes
    assert small.tokens.tolist() == [[6, 8, 2, 4, 1]]
    assert first_nodes(big, 4) == first_nodes(small, 4)
    one = d.propose(view(rows, [6], draft_depth=3, beam_width=1))       # one path only
    assert one.tokens.tolist() == [[6, 8, 2, 4]]


class CountingNGram:
    """Fake corpus model: after token t comes t + 1 with probability 0.5, up to 5 (then 0.05)."""

    order = 2

    def top_next(self, ctx, k, min_count=1):
        t = int(ctx[0, -1]) + 1
        return np.array([[t]]), np.array([[0.5 if t <= 5 else 0.05]])


def test_ngram_drafter_falls_back_to_a_greedy_corpus_chain():
    d = NGramDrafter(CountingNGram())
    tree = d.propose(view([[20, 21]], [2], draft_depth=8))             # nothing repeats
    assert tree.tokens.tolist() == [[2, 3, 4, 5]]                       # stops where p < 0.1
    assert tree.parents.tolist() == [[-1, 0, 1, 2]]
    tree = d.propose(view([[20, 21]], [2], draft_depth=2))
    assert tree.tokens.tolist() == [[2, 3, 4]]                          # draft_depth


# ---- DART and EAGLE ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["dart", "eagle"])
def test_dart_and_eagle_trees_keep_budget_depth_and_priority_order(tiny, method):
    d = build(method, tiny, "random")
    H = tiny.args.hidden_size
    assert d.max_draft_depth == 8 and len(d.taps) == 3
    trees = {}
    for budget in (5, 12):
        prefill(d, ROWS, ROOTS, H)                       # the same state before each proposal
        trees[budget] = d.propose(view(ROWS, ROOTS, tree_budget=budget))
        check_tree(trees[budget], ROOTS, budget, depth=4, top_k=KNOBS["top_k"])
    # the best 5-node tree is the first 5 nodes of the 12-node one (the controller relies on it)
    assert first_nodes(trees[12], 5) == first_nodes(trees[5], 5)
    assert trees[12].valid.sum(1).tolist() == [13, 13]
    # after a proposal the pending context is in the drafter's cache: a row's whole prompt
    assert d.cache.lengths[:2] == [7, 3] and d.pending[:2] == [None, None]


def test_dart_draft_depth_is_capped_by_the_trained_depth_and_lookups_lead(tiny):
    d = build("dart", tiny, "random")
    prefill(d, ROWS, ROOTS, tiny.args.hidden_size)
    logits = d.draft_logits(2, 3)
    assert logits.shape == (2, 3, tiny.args.vocab_size) and logits.dtype == torch.float32
    prefill(d, ROWS, ROOTS, tiny.args.hidden_size)
    v = view(ROWS, ROOTS, draft_depth=20, lookup_paths=1, lookup_len=3, lookup_min_match=2)
    assert d.max_tree_nodes(v.decoding) == 12 + 1 * 3
    tree = d.propose(v)
    check_tree(tree, ROOTS, budget=15, depth=8)
    # row 0's text ends in 11 12 13, seen before and followed by 14 15 11: those are nodes 1..3
    assert tree.tokens[0, 1:4].tolist() == [14, 15, 11]
    assert tree.parents[0, 1:4].tolist() == [0, 1, 2]


def test_dart_skips_the_drafter_where_lookup_paths_fill_the_kept_nodes(tiny):
    """Lookup paths lead DART's merged tree; when they alone fill the nodes the engine keeps
    (``BatchView.max_nodes``) in every row, the drafter's forward and search are skipped and the
    kept tree is the same; the drafter keeps the context for its next forward."""
    d = build("dart", tiny, "random")
    H = tiny.args.hidden_size
    rows, roots = [[11, 12, 13, 14, 15, 11, 12], [7, 8, 9, 10, 7, 8]], [13, 9]
    knobs = dict(draft_depth=8, lookup_paths=1, lookup_len=4, lookup_min_match=2)
    prefill(d, rows, roots, H)
    full = d.propose(view(rows, roots, **knobs))                    # the whole tree: drafter runs
    assert d.lookup_only_steps == 0 and d.pending[:2] == [None, None]
    for keep, skipped in ((3, True), (4, True), (5, False)):        # each lookup trie has 4 nodes
        prefill(d, rows, roots, H)
        v = view(rows, roots, **knobs)
        v.max_nodes = keep
        before = d.lookup_only_steps
        cut = d.propose(v)
        assert (d.lookup_only_steps == before + 1) == skipped
        assert (d.pending[0] is not None) == skipped                # no forward: context waits
        assert first_nodes(cut.truncate(keep), keep) == first_nodes(full.truncate(keep), keep)
    # one row without a match: the drafter runs for the whole batch
    prefill(d, [rows[0], [7, 8, 9]], [13, 10], H)
    v = view([rows[0], [7, 8, 9]], [13, 10], **knobs)
    v.max_nodes = 2
    d.propose(v)
    assert d.lookup_only_steps == 2 and d.pending[:2] == [None, None]


def test_dart_says_when_a_forward_took_a_prompt(tiny):
    """``caught_up``: the forward took a row's prompt (not a step's drafting cost). A lookup-only
    step runs no forward and the one after it is ordinary; the flag moves with a compacted row."""
    d = build("dart", tiny, "random")
    H = tiny.args.hidden_size
    rows, roots = [[11, 12, 13, 14, 15, 11, 12], [7, 8, 9, 10, 7, 8]], [13, 9]
    knobs = dict(draft_depth=4, lookup_paths=1, lookup_len=4, lookup_min_match=2)
    prefill(d, rows, roots, H)
    d.propose(view(rows, roots, **knobs))
    assert d.caught_up                                               # both prompts
    def commit_one():                                                # what a step hands the drafter
        d.observe(None, [1, 1], torch.randn(2, 1, len(d.taps) * H), torch.tensor([[14], [7]]))

    commit_one()                                                     # after that forward
    v = view(rows, roots, **knobs)
    v.max_nodes = 3                                                  # lookup paths fill it
    d.propose(v)
    assert d.lookup_only_steps == 1 and not d.caught_up
    commit_one()
    d.propose(view(rows, roots, **knobs))                            # the forward after it
    assert not d.caught_up and d.pending[:2] == [None, None]
    commit_one()                                                     # both rows drafted already,
    d.prefill(slice(1, 2), [3], torch.randn(1, 3, len(d.taps) * H),  # then row 1 takes a prompt
              torch.tensor([[8, 9, 9]]))
    d.move_row(1, 0)                                                 # row 1's prompt -> row 0
    d.release_row(1)
    assert d.prompted[:2] == [True, False]


def test_dart_rows_need_pending_context(tiny):
    d = build("dart", tiny, "random")
    with pytest.raises(RuntimeError, match="no pending context"):
        d.propose(view(ROWS, ROOTS))


def test_eagle_select_keeps_the_best_nodes_prefix_closed_by_hand():
    # level 1: 10 (-0.1), 11 (-1.0); level 2 (children of 10, 10, 11, 11): 20..23
    node_tok = [torch.tensor([[10, 11]]), torch.tensor([[20, 21, 22, 23]])]
    node_score = [torch.tensor([[-0.1, -1.0]]), torch.tensor([[-0.3, -2.0, -1.0, -1.5]])]
    node_parent = [torch.tensor([[-1, -1]]), torch.tensor([[0, 0, 1, 1]])]
    tree = EagleDrafter._select(torch.tensor([5]), node_tok, node_score, node_parent, budget=4)
    # by score: 10, 20, then 11 and 22 tie at -1.0 and the shallower node goes first
    assert tree.tokens.tolist() == [[5, 10, 20, 11, 22]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3]]
    assert tree.depths.tolist() == [[0, 1, 2, 1, 2]]
    small = EagleDrafter._select(torch.tensor([5]), node_tok, node_score, node_parent, budget=2)
    assert first_nodes(small, 2) == first_nodes(tree, 2)
    # a child whose parent was not kept (only with non-finite scores) is dropped
    node_score[0] = torch.tensor([[-0.1, float("-inf")]])
    node_score[1] = torch.tensor([[-0.3, -2.0, -0.2, -1.5]])
    tree = EagleDrafter._select(torch.tensor([5]), node_tok, node_score, node_parent, budget=3)
    assert tree.tokens.tolist() == [[5, 10, 20]] and tree.parents.tolist() == [[-1, 0, 1]]


# ---- Medusa --------------------------------------------------------------------------------------

def test_medusa_keeps_one_hidden_vector_per_row_and_drafts_in_the_draft_vocab(tiny, tiny_baselines):
    d = build("medusa", tiny, str(tiny_baselines["medusa"]))
    H, V = tiny.args.hidden_size, tiny.args.vocab_size
    assert d.taps == (tiny.args.num_layers,) and d.max_draft_depth == 4
    taps = torch.randn(2, 7, H)
    d.prefill(slice(0, 2), [7, 3], taps, torch.zeros(2, 7, dtype=torch.long))
    assert torch.equal(d.last[0], taps[0, 6]) and torch.equal(d.last[1], taps[1, 2])
    logits = d.draft_logits(2, 3)                                     # [B, depth, V]
    assert logits.shape == (2, 3, V)
    assert int(torch.isfinite(logits).sum()) == 2 * 3 * 4096          # only the draft vocabulary
    assert torch.isfinite(logits[..., d.model.d2t]).all()
    for budget in (4, 12):
        tree = d.propose(view(ROWS, ROOTS, tree_budget=budget, draft_depth=8))
        check_tree(tree, ROOTS, budget, depth=4)
        if budget == 4:
            small = tree
    assert first_nodes(tree, 4) == first_nodes(small, 4)
    # observe: the residual at each row's last committed position; move_row: compaction
    step = torch.randn(2, 3, H)
    d.observe(None, [3, 1], step, torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(d.last[0], step[0, 2]) and torch.equal(d.last[1], step[1, 0])
    d.move_row(1, 0)
    assert torch.equal(d.last[0], step[1, 0])


# ---- SpS -----------------------------------------------------------------------------------------

def sps_greedy_chain(d, seq: list[int], n: int) -> list[int]:
    """The draft model's greedy chain, each token from a full uncached forward (the training
    forward) over the sequence so far."""
    head = d.head
    out = []
    for _ in range(n):
        logits = sps_train_forward(d.model, d.embed, torch.tensor([seq + out]), head)
        out.append(int(d.model.d2t[logits[0, -1, 0].argmax()]))
    return out


def test_sps_drafts_the_draft_models_greedy_chain(tiny, tiny_baselines):
    d = build("sps", tiny, str(tiny_baselines["sps"]))
    assert d.max_draft_depth == 5 and d.taps == ()
    assert d.max_tree_nodes(DecodingConfig(draft_depth=8)) == 5
    assert d.max_tree_nodes(DecodingConfig(draft_depth=3)) == 3
    d.prefill(slice(0, 2), [7, 3], None, torch.zeros(2, 7, dtype=torch.long))
    tree = d.propose(view(ROWS, ROOTS, draft_depth=3))
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert tree.depths.tolist() == [[0, 1, 2, 3]] * 2
    assert tree.valid.all() and tree.draft_probs is None             # greedy: nothing sampled
    for b in range(2):
        want = sps_greedy_chain(d, ROWS[b] + [ROOTS[b]], 3)
        assert tree.tokens[b].tolist() == [ROOTS[b]] + want
    # the catch-up chunk (committed tokens + root) is now in the draft model's cache
    assert d.cache.lengths[:2] == [8, 4]
    # next step: two more committed tokens per row, caught up in one chunk
    rows = [ROWS[0] + [13, 14], ROWS[1] + [10, 3]]
    tree = d.propose(view(rows, [15, 4], draft_depth=2))
    assert d.cache.lengths[:2] == [10, 6]
    for b, root in enumerate([15, 4]):
        assert tree.tokens[b].tolist() == [root] + sps_greedy_chain(d, rows[b] + [root], 2)


def test_sps_sampled_rows_carry_their_draft_distribution(tiny, tiny_baselines):
    d = build("sps", tiny, str(tiny_baselines["sps"]))
    V = tiny.args.vocab_size
    d.prefill(slice(0, 2), [7, 3], None, torch.zeros(2, 7, dtype=torch.long))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20)]
    v = view(ROWS, ROOTS, params=params, draft_depth=3)
    v.randoms = [None, RequestRandom(0)]
    tree = d.propose(v)
    q = tree.draft_probs
    assert q.shape == (2, 4, V)
    assert not q[0].any() and not q[1, 0].any()                       # greedy row, root slot
    torch.testing.assert_close(q[1, 1:].sum(-1), torch.ones(3))
    assert ((q[1, 1:] > 0).sum(-1) <= 20).all()                       # the row's own top_k
    toks = tree.tokens[1, 1:]
    assert (q[1, torch.arange(1, 4), toks] > 0).all()                 # drawn from q
