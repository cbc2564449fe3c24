"""Tests for dart_ray.ngram: counts, backoff, pruning, top_next, persistence, corpus building."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np
import pytest

from dart_ray.ngram import NGramModel, build_ngram, build_ngram_cli, iter_texts

# Tiny corpus: two sequences.
#   seq A: 1 2 3 1 2 4
#   seq B: 2 3 5
SEQS = [[1, 2, 3, 1, 2, 4], [2, 3, 5]]


def _m(seqs=SEQS, order=3, min_count=1, vocab_size=10) -> NGramModel:
    return NGramModel.from_sequences(seqs, order=order, min_count=min_count, vocab_size=vocab_size)


def _p(model: NGramModel, ctx: list[list[int]], toks: list[int], min_count: int = 1) -> np.ndarray:
    return model.prob(np.array(ctx, dtype=np.int64), np.array(toks, dtype=np.int64), min_count)


# ----------------------------------------------------------------------------- counts / backoff


def test_hand_computed_counts():
    m = _m()
    assert m.num_tokens_trained == 9
    assert m.num_entries == [5, 5, 5]  # {1..5}; {12,23,31,24,35}; {123,231,312,124,235}
    # trigram (1,2) -> 3 seen once, (1,2) -> 4 once: P = 1/2
    np.testing.assert_allclose(_p(m, [[1, 2], [1, 2]], [3, 4]), [0.5, 0.5])
    # trigram (2,3)->1 once (seq A), (2,3)->5 once (seq B)
    np.testing.assert_allclose(_p(m, [[2, 3], [2, 3]], [1, 5]), [0.5, 0.5])
    # trigram (3,1)->2 once, total 1
    np.testing.assert_allclose(_p(m, [[3, 1]], [2]), [1.0])
    count, total, level = m.lookup(np.array([[1, 2]]), np.array([3]))
    assert (count[0], total[0], level[0]) == (1, 2, 3)


def test_bigram_and_unigram_values():
    m = _m()
    # bigrams: 1->2 x2; 2->3 x2, 2->4 x1; 3->1 x1, 3->5 x1
    np.testing.assert_allclose(_p(m, [[-1, 1]], [2]), [1.0])
    np.testing.assert_allclose(_p(m, [[-1, 2], [-1, 2]], [3, 4]), [2 / 3, 1 / 3], rtol=1e-6)
    # unigrams: 1:2 2:3 3:2 4:1 5:1 over 9
    np.testing.assert_allclose(
        _p(m, [[-1, -1]] * 5, [1, 2, 3, 4, 5]), np.array([2, 3, 2, 1, 1]) / 9, rtol=1e-6
    )


def test_backoff_chain():
    m = _m()
    # full ctx (1,2) unseen with token 5 and bigram 2->5 unseen -> unigram 1/9
    c, t, lvl = m.lookup(np.array([[1, 2]]), np.array([5]))
    assert (c[0], t[0], lvl[0]) == (1, 9, 1)
    # ctx (4,2) unseen as a trigram context -> bigram 2->3 = 2/3
    c, t, lvl = m.lookup(np.array([[4, 2]]), np.array([3]))
    assert (c[0], t[0], lvl[0]) == (2, 3, 2)
    # ctx (3,1) seen, but token 3 after it not -> bigram (1->3) unseen -> unigram 2/9
    np.testing.assert_allclose(_p(m, [[3, 1]], [3]), [2 / 9], rtol=1e-6)


def test_negative_context_skips_suffix():
    m = _m()
    # -1 in the last position: both trigram and bigram suffixes contain it -> unigram
    c, t, lvl = m.lookup(np.array([[1, -1]]), np.array([2]))
    assert (c[0], t[0], lvl[0]) == (3, 9, 1)
    # -1 in the first position: bigram only
    c, t, lvl = m.lookup(np.array([[-1, 1]]), np.array([2]))
    assert (c[0], t[0], lvl[0]) == (2, 2, 2)
    # -5 treated the same as -1
    np.testing.assert_allclose(_p(m, [[-5, 1]], [2]), [1.0])


def test_unseen_prob_zero_logprob_neg_inf():
    m = _m()
    ctx = np.array([[1, 2], [1, 2], [1, 2], [1, 2]], dtype=np.int64)
    tok = np.array([7, 9, -1, 1 << 21], dtype=np.int64)  # in vocab but unseen, negative, huge
    p = m.prob(ctx, tok)
    lp = m.log_prob(ctx, tok)
    assert p.dtype == np.float32 and lp.dtype == np.float32
    assert np.all(p == 0.0)
    assert np.all(np.isneginf(lp))
    lp2 = m.log_prob(np.array([[1, 2]]), np.array([3]))
    np.testing.assert_allclose(lp2, [np.log(0.5)], rtol=1e-6)


def test_sequence_boundaries_not_crossed():
    m = _m()
    # joining A and B would create bigram 4->2 and trigrams (2,4)->2, (4,2)->3
    _, _, lvl = m.lookup(np.array([[-1, 4], [2, 4], [4, 2]]), np.array([2, 2, 3]))
    assert lvl[0] == 1  # 4->2 unseen as bigram: unigram
    assert lvl[1] == 1
    assert lvl[2] == 2  # (4,2) unseen trigram context -> bigram 2->3
    # single-token and empty sequences contribute only unigrams
    m2 = _m(seqs=[[1], [], [2], [3]])
    assert m2.num_entries == [3, 0, 0]
    assert m2.num_tokens_trained == 3


def test_min_count_build_and_lookup():
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2, 4]]
    # trigrams: (1,2,3) x2, (2,3,1) x2, (3,1,2) x2, (1,2,4) x1
    full = _m(seqs=seqs)
    pruned = _m(seqs=seqs, min_count=2)
    assert pruned.num_entries[2] == 3 and full.num_entries[2] == 4
    assert pruned.min_count == 2
    ctx = np.array([[1, 2], [1, 2], [2, 3], [-1, 2], [-1, -1]], dtype=np.int64)
    tok = np.array([4, 3, 1, 4, 4], dtype=np.int64)
    # (1,2)->4 count 1: kept with min_count 1
    np.testing.assert_allclose(full.prob(ctx[:1], tok[:1]), [1 / 3], rtol=1e-6)
    # runtime min_count=2 on the full model == build min_count=2 (raw totals kept)
    a = full.prob(ctx, tok, min_count=2)
    b = pruned.prob(ctx, tok, min_count=1)
    np.testing.assert_array_equal(a, b)
    # (1,2)->4 pruned at trigram, 2->4 pruned at bigram (count 1), 4 unigram count 1 pruned too
    assert a[0] == 0.0
    np.testing.assert_allclose(a[1], 2 / 3, rtol=1e-6)  # raw total of ctx (1,2) is 3
    # unigram 1: count 3, raw total 9
    np.testing.assert_allclose(full.prob(np.array([[-1, -1]]), np.array([1]), 3), [3 / 9])
    assert full.prob(np.array([[-1, -1]]), np.array([1]), 4)[0] == 0.0


def test_order_validation_and_vocab():
    with pytest.raises(ValueError, match="order"):
        NGramModel.from_sequences(SEQS, order=4, vocab_size=10)
    with pytest.raises(ValueError, match="order"):
        NGramModel.from_sequences(SEQS, order=0, vocab_size=10)
    with pytest.raises(ValueError, match="vocab_size"):
        NGramModel.from_sequences(SEQS, vocab_size=1 << 21)
    with pytest.raises(ValueError, match="token ids"):
        NGramModel.from_sequences([[1, 2, 10]], vocab_size=10)
    with pytest.raises(ValueError, match="min_count"):
        NGramModel.from_sequences(SEQS, min_count=0, vocab_size=10)
    with pytest.raises(ValueError, match="min_count"):
        _m().prob(np.array([[1, 2]]), np.array([3]), min_count=0)
    with pytest.raises(ValueError, match="rows"):
        _m().prob(np.array([[1, 2]]), np.array([3, 4]))


def test_orders_1_and_2():
    m1 = _m(order=1)
    np.testing.assert_allclose(m1.prob(np.zeros((2, 0), np.int64), np.array([2, 7])), [3 / 9, 0])
    # wider context than needed: the last order-1 columns are used
    m2 = _m(order=2)
    np.testing.assert_allclose(m2.prob(np.array([[9, 9, 2]]), np.array([3])), [2 / 3], rtol=1e-6)
    tok, p = m2.top_next(np.array([[2]]), k=3)
    assert tok.tolist() == [[3, 4, -1]]
    np.testing.assert_allclose(p, [[2 / 3, 1 / 3, 0.0]], rtol=1e-6)


def test_lengths_and_empty_inputs():
    m = _m()
    out = m.log_prob(np.zeros((0, 2), np.int64), np.zeros(0, np.int64))
    assert out.shape == (0,)
    tok, p = m.top_next(np.zeros((0, 2), np.int64), k=4)
    assert tok.shape == (0, 4) and p.shape == (0, 4)
    empty = _m(seqs=[])
    assert empty.num_tokens_trained == 0
    assert empty.prob(np.array([[1, 2]]), np.array([3]))[0] == 0.0
    tok, p = empty.top_next(np.array([[1, 2]]), k=2)
    assert tok.tolist() == [[-1, -1]] and p.tolist() == [[0.0, 0.0]]


# ----------------------------------------------------------------------------- top_next


def test_top_next_ordering_and_padding():
    seqs = [[1, 2, 3], [1, 2, 3], [1, 2, 5], [1, 2, 4], [1, 2, 4], [1, 2, 6], [7, 7]]
    m = _m(seqs=seqs)
    tok, p = m.top_next(np.array([[1, 2], [8, 2], [1, 7], [-1, -1]]), k=5)
    assert tok.dtype == np.int64 and p.dtype == np.float32
    # ctx (1,2): 3 x2, 4 x2, 5 x1, 6 x1 -> ties broken by smaller token id
    assert tok[0].tolist() == [3, 4, 5, 6, -1]
    np.testing.assert_allclose(p[0], [2 / 6, 2 / 6, 1 / 6, 1 / 6, 0.0], rtol=1e-6)
    # ctx (8,2): trigram unseen -> bigram 2->(same) distribution
    assert tok[1].tolist() == [3, 4, 5, 6, -1]
    # ctx (1,7): trigram unseen, bigram 7->7 count 1
    assert tok[2].tolist() == [7, -1, -1, -1, -1]
    np.testing.assert_allclose(p[2, 0], 1.0)
    # unigram: 1 x6, 2 x6, 7 x2, 3 x2, 4 x2, ...
    assert tok[3].tolist() == [1, 2, 3, 4, 7]
    # probabilities agree with prob() for each returned token
    ctx = np.array([[1, 2], [8, 2], [1, 7], [-1, -1]])
    for j in range(5):
        ok = tok[:, j] >= 0
        np.testing.assert_allclose(p[ok, j], m.prob(ctx[ok], tok[ok, j]), rtol=1e-6)


def test_top_next_min_count_backs_off():
    seqs = [[1, 2, 3], [1, 2, 4], [9, 2, 4], [5, 2, 4]]
    m = _m(seqs=seqs)
    # ctx (1,2): 3 x1, 4 x1. With min_count=2 the trigram context has nothing -> bigram 2->4 x3
    tok, p = m.top_next(np.array([[1, 2]]), k=2, min_count=2)
    assert tok.tolist() == [[4, -1]]
    np.testing.assert_allclose(p, [[3 / 4, 0.0]], rtol=1e-6)
    tok, p = m.top_next(np.array([[1, 2]]), k=2, min_count=1)
    assert tok.tolist() == [[3, 4]]
    with pytest.raises(ValueError, match="k must"):
        m.top_next(np.array([[1, 2]]), k=0)


# ----------------------------------------------------------------------------- reference check


def _reference(seqs, order):
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for s in seqs:
        for n in range(1, order + 1):
            for i in range(len(s) - n + 1):
                counts[tuple(s[i : i + n])] += 1
    totals: dict[tuple[int, ...], int] = defaultdict(int)
    for key, c in counts.items():
        totals[key[:-1]] += c
    return counts, totals


def _ref_prob(counts, totals, ctx, tok, order, min_count):
    ctx = list(ctx)
    for c in range(order - 1, -1, -1):
        suffix = tuple(ctx[len(ctx) - c :]) if c else ()
        if any(x < 0 for x in suffix):
            continue
        cnt = counts.get(suffix + (tok,), 0)
        if cnt >= min_count:
            return cnt / totals[suffix]
    return 0.0


def _ref_top(counts, totals, ctx, k, order, min_count):
    ctx = list(ctx)
    for c in range(order - 1, -1, -1):
        suffix = tuple(ctx[len(ctx) - c :]) if c else ()
        if any(x < 0 for x in suffix):
            continue
        cands = [
            (key[-1], cnt)
            for key, cnt in counts.items()
            if len(key) == c + 1 and key[:-1] == suffix and cnt >= min_count
        ]
        if cands:
            cands.sort(key=lambda x: (-x[1], x[0]))
            return [(t, cnt / totals[suffix]) for t, cnt in cands[:k]]
    return []


@pytest.mark.parametrize("build_min,run_min", [(1, 1), (1, 2), (2, 1), (2, 3)])
def test_matches_dict_reference(build_min, run_min):
    rng = np.random.default_rng(0)
    vocab = 50
    # skewed distribution so that many n-grams repeat; several sequences of varying length
    probs = rng.dirichlet(np.full(vocab, 0.3))
    seqs = [rng.choice(vocab, size=int(n), p=probs).tolist() for n in rng.integers(0, 400, 25)]
    assert sum(map(len, seqs)) > 4000
    m = NGramModel.from_sequences(
        seqs, order=3, min_count=build_min, vocab_size=vocab, chunk_tokens=700
    )
    counts, totals = _reference(seqs, 3)
    eff_min = max(build_min, run_min)

    q = 1000
    # half the queries take real contexts from the corpus, half are random (incl. -1)
    flat = np.concatenate([np.array(s, dtype=np.int64) for s in seqs])
    starts = rng.integers(0, flat.size - 3, q // 2)
    ctx_real = np.stack([flat[starts], flat[starts + 1]], axis=1)
    ctx_rand = rng.integers(-1, vocab, (q - q // 2, 2))
    ctx = np.concatenate([ctx_real, ctx_rand]).astype(np.int64)  # [q, 2]
    tok = rng.choice(vocab, size=q, p=probs).astype(np.int64)  # [q]

    got = m.prob(ctx, tok, min_count=run_min)
    want = np.array(
        [_ref_prob(counts, totals, ctx[i], int(tok[i]), 3, eff_min) for i in range(q)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    lp = m.log_prob(ctx, tok, min_count=run_min)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(lp, np.log(want).astype(np.float32), rtol=1e-5)

    k = 6
    ttok, tp = m.top_next(ctx[:200], k=k, min_count=run_min)
    for i in range(200):
        ref = _ref_top(counts, totals, ctx[i], k, 3, eff_min)
        assert ttok[i, : len(ref)].tolist() == [t for t, _ in ref]
        assert np.all(ttok[i, len(ref) :] == -1)
        np.testing.assert_allclose(tp[i, : len(ref)], [p for _, p in ref], rtol=1e-6)
        assert np.all(tp[i, len(ref) :] == 0.0)


def test_lookup_is_fast():
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 5000, 300_000)
    m = NGramModel.from_sequences([seq], vocab_size=5000)
    ctx = rng.integers(0, 5000, (500, 2))
    tok = rng.integers(0, 5000, 500)
    m.log_prob(ctx, tok)
    t0 = time.perf_counter()
    for _ in range(20):
        m.log_prob(ctx, tok)
    per_call = (time.perf_counter() - t0) / 20
    assert per_call < 5e-3, per_call  # typically ~0.1-0.3 ms; generous bound for busy CI


# ----------------------------------------------------------------------------- save / load


def test_save_load_roundtrip(tmp_path):
    m = NGramModel.from_sequences(
        SEQS, vocab_size=10, meta={"tokenizer": "tok-x", "target": "model-y"}
    )
    out = m.save(tmp_path / "ng")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["order"] == 3 and meta["vocab_size"] == 10 and meta["min_count"] == 1
    assert meta["num_tokens_trained"] == 9 and meta["format_version"] == 1
    assert meta["tokenizer"] == "tok-x" and meta["target"] == "model-y"

    loaded = NGramModel.load(out)
    assert loaded.is_mmap
    assert loaded.equals(m)
    assert loaded.meta["tokenizer"] == "tok-x"
    assert loaded.size_bytes() == m.size_bytes()
    ctx = np.array([[1, 2], [4, 2], [-1, -1], [2, 3]])
    tok = np.array([3, 3, 5, 5])
    np.testing.assert_array_equal(loaded.log_prob(ctx, tok), m.log_prob(ctx, tok))
    for a, b in zip(loaded.top_next(ctx, 3), m.top_next(ctx, 3), strict=True):
        np.testing.assert_array_equal(a, b)
    in_mem = NGramModel.load(out, mmap=False)
    assert not in_mem.is_mmap and in_mem.equals(m)
    assert "NGramModel(order=3" in repr(loaded) and "mmap" in repr(loaded)
    # overwriting an existing directory works
    _m(seqs=[[1, 1, 1]]).save(out)
    assert NGramModel.load(out).num_tokens_trained == 3


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        NGramModel.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        NGramModel.load(tmp_path / "empty")

    d = _m().save(tmp_path / "ng")
    (d / "ngram2_counts.npy").unlink()
    with pytest.raises(FileNotFoundError, match="ngram2_counts.npy"):
        NGramModel.load(d)

    d = _m().save(tmp_path / "ng2")
    (d / "ngram3_keys.npy").write_bytes(b"garbage, not numpy")
    with pytest.raises(ValueError, match="ngram3_keys.npy"):
        NGramModel.load(d)

    d = _m().save(tmp_path / "ng3")
    np.save(d / "ctx1_totals.npy", np.zeros(2, dtype=np.float64))
    with pytest.raises(ValueError, match="ctx1_totals.npy"):
        NGramModel.load(d)

    d = _m().save(tmp_path / "ng4")
    (d / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="meta.json"):
        NGramModel.load(d)

    d = _m().save(tmp_path / "ng5")
    meta = json.loads((d / "meta.json").read_text())
    meta["format_version"] = 99
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format_version"):
        NGramModel.load(d)

    d = _m().save(tmp_path / "ng6")
    np.save(d / "ngram1_counts.npy", np.zeros(1, dtype=np.uint32))  # wrong length
    with pytest.raises(ValueError, match="lengths differ"):
        NGramModel.load(d)


def test_load_is_fast(tmp_path):
    rng = np.random.default_rng(2)
    m = NGramModel.from_sequences([rng.integers(0, 30000, 400_000)], vocab_size=30000)
    d = m.save(tmp_path / "big")
    t0 = time.perf_counter()
    loaded = NGramModel.load(d)
    assert time.perf_counter() - t0 < 0.5
    assert loaded.is_mmap and loaded.size_bytes() > 5 * 2**20


# ----------------------------------------------------------------------------- corpus / build


def test_iter_texts_formats(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "a.txt").write_text("first para\nline two\n\n\n  second para  \n\n")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "json one", "x": 1}) + "\n\n")
        f.write(json.dumps({"text": None}) + "\n")
        f.write(json.dumps({"text": "json two"}) + "\n")
    pq.write_table(pa.table({"text": ["pq one", None, "pq two"], "y": [1, 2, 3]}),
                   tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("a,b\n")

    assert list(iter_texts([str(tmp_path / "a.txt")])) == ["first para\nline two", "second para"]
    assert list(iter_texts([tmp_path / "b.jsonl"])) == ["json one", "json two"]
    assert list(iter_texts([tmp_path / "c.parquet"])) == ["pq one", "pq two"]
    # directory: recursive, sorted, ignores other extensions
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "d.txt").write_text("nested")
    assert list(iter_texts([tmp_path])) == [
        "first para\nline two", "second para", "json one", "json two", "pq one", "pq two",
        "nested",
    ]


def test_iter_texts_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "ok"}) + "\n")
        f.write(json.dumps({"content": "no text field"}) + "\n")
    with pytest.raises(ValueError, match=r"b\.jsonl:2.*'text'"):
        list(iter_texts([tmp_path / "b.jsonl"]))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c\.parquet.*'text'"):
        list(iter_texts([tmp_path / "c.parquet"]))
    assert list(iter_texts([tmp_path / "c.parquet"], text_column="body")) == ["x"]
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        iter_texts([tmp_path / "missing.txt"])
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported"):
        iter_texts([tmp_path / "x.csv"])
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        iter_texts([tmp_path / "emptydir"])


class FakeTokenizer:
    """Whitespace tokenizer over a fixed vocabulary; records calls."""

    name_or_path = "fake-tok"

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.calls: list[tuple[int, bool]] = []

    def __len__(self) -> int:
        return 100

    def __call__(self, texts, add_special_tokens=True):
        self.calls.append((len(texts), add_special_tokens))
        ids = [[self.vocab.setdefault(w, len(self.vocab)) for w in t.split()] for t in texts]
        return {"input_ids": ids}


def test_build_ngram_with_fake_tokenizer(tmp_path):
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in ["a b c a b d", "b c e", "a b c"])
    tok = FakeTokenizer()
    m = build_ngram([str(tmp_path / "c.jsonl")], tok, order=3, progress=False, batch_size=2)
    assert tok.calls == [(2, False), (1, False)]
    a, b, c = tok.vocab["a"], tok.vocab["b"], tok.vocab["c"]
    assert m.vocab_size == 100 and m.num_tokens_trained == 12
    assert m.meta["tokenizer"] == "fake-tok" and m.meta["num_texts"] == 3
    # (a, b) -> c twice, -> d once
    np.testing.assert_allclose(m.prob(np.array([[a, b]]), np.array([c])), [2 / 3], rtol=1e-6)
    # texts are separate sequences: "d" (end of text 1) followed by "b" (text 2) never counted
    d = tok.vocab["d"]
    assert m.lookup(np.array([[-1, d]]), np.array([b]))[2][0] == 1
    # same result with progress bar on
    m2 = build_ngram(tmp_path / "c.jsonl", FakeTokenizer(), progress=True)
    assert m2.num_tokens_trained == 12
    (tmp_path / "e.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no tokens"):
        build_ngram([tmp_path / "e.txt"], FakeTokenizer(), progress=False)


def test_build_ngram_cli(tmp_path, monkeypatch, capsys):
    import sys
    import types

    (tmp_path / "c.txt").write_text("x y z x y\n\nx y w\n")
    fake_models = types.ModuleType("dart_ray.models")
    seen: list[str | None] = []

    def load_tokenizer(model):
        seen.append(model)
        return FakeTokenizer()

    fake_models.load_tokenizer = load_tokenizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dart_ray.models", fake_models)
    out = tmp_path / "out"
    rc = build_ngram_cli(
        [str(tmp_path / "c.txt"), "--out", str(out), "--order", "2", "--min-count", "1",
         "--model", "some/model", "--no-progress"]
    )
    assert rc == 0 and seen == ["some/model"]
    m = NGramModel.load(out)
    assert m.order == 2 and m.num_tokens_trained == 8
    assert m.meta["target"] == "some/model"
    printed = capsys.readouterr().out
    assert "tokens" in printed and "MB" in printed


def test_build_ngram_cli_leaves_out_evaluation_prompts_and_reports_bad_input(tmp_path,
                                                                            monkeypatch, capsys):
    """A corpus text holding an evaluation prompt the project ships is dropped (counted in the
    model's meta) unless --keep-eval-prompts; a corpus without the text column is an error, exit
    2, not a traceback."""
    import sys
    import types

    from dart_ray.bench.prompts import CHAT_SET, load_prompts

    chat = load_prompts(CHAT_SET)[:2]
    with open(tmp_path / "c.jsonl", "w") as f:
        for text in ["x y z x y", *chat, "x y w"]:
            f.write(json.dumps({"text": text}) + "\n")
    fake_models = types.ModuleType("dart_ray.models")
    fake_models.load_tokenizer = lambda model: FakeTokenizer()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dart_ray.models", fake_models)
    rc = build_ngram_cli([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "a"), "--order", "2",
                          "--no-progress"])
    m = NGramModel.load(tmp_path / "a")
    assert rc == 0 and m.meta["num_texts"] == 2 and m.meta["evaluation_texts_dropped"] == 2
    assert "2 holding an evaluation prompt dropped" in capsys.readouterr().out
    rc = build_ngram_cli([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "b"), "--order", "2",
                          "--no-progress", "--keep-eval-prompts"])
    assert rc == 0 and NGramModel.load(tmp_path / "b").meta["num_texts"] == 4
    rc = build_ngram_cli([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "c"),
                          "--text-column", "prompt", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "text column 'prompt' missing" in err and "Traceback" not in err


def test_an_ngram_model_over_a_larger_vocabulary_than_the_target_is_refused(tmp_path):
    """It proposed ids the target cannot embed: every step of every request failed with an
    IndexError inside the target's embedding. Built for another target of the same vocabulary:
    allowed, with a warning."""
    from types import SimpleNamespace

    from dart_ray.drafters import check_ngram_target

    big = NGramModel.from_sequences([[1, 2, 3, 40000]], vocab_size=49152,
                                    meta={"target": "SmolLM2-135M-Instruct"})
    target = SimpleNamespace(args=SimpleNamespace(vocab_size=32000), model_id="llama-32k")
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens.*llama-32k has 32000"):
        check_ngram_target(big, target, tmp_path)
    same = SimpleNamespace(args=SimpleNamespace(vocab_size=49152), model_id="my-finetune")
    with pytest.warns(UserWarning, match="built for SmolLM2-135M-Instruct"):
        check_ngram_target(big, same, tmp_path)
    small = NGramModel.from_sequences([[1, 2, 3]], vocab_size=16)
    check_ngram_target(small, target, tmp_path)             # a smaller vocabulary is fine
