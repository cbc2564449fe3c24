"""Incremental detokenisation and stop strings (:mod:`dart_ray.engine.detok`): text is readable as
soon as its characters are complete, also when multi-token pushes keep ending inside a UTF-8
character (CJK text), and a stop string keeps the fewest ids whose text contains it."""

from __future__ import annotations

import random

import pytest

from dart_ray.engine.detok import IncrementalDetokenizer, RequestText

CJK = "中文翻译：我爱北京天安门。我爱北京天安门。我爱北京天安门。我爱北京"
CJK_OUT = "天安门。我爱北京天安门。我爱北，中文🙂 and some English too。"
ASCII = "The quick brown fox jumps over the lazy dog, then naps in the sun."


@pytest.fixture(scope="module")
def tok(smollm_dir):
    from dart_ray.models.loading import load_tokenizer

    return load_tokenizer(smollm_dir)


class ByteTokenizer:
    """A byte-level tokenizer: ids 0-255 are bytes, 256 a special token (skipped or shown)."""

    SPECIAL = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i == self.SPECIAL:
                out.append(run.decode(errors="replace"))
                run = bytearray()
                if not skip_special_tokens:
                    out.append("<s>")
            else:
                run.append(i)
        return "".join(out) + run.decode(errors="replace")


def completion_ids(tok, prompt: str, out: str) -> list[int]:
    """The ids of ``out`` as they follow ``prompt`` (so they split characters as in generation)."""
    pids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(prompt + out, add_special_tokens=False)["input_ids"][len(pids):]
    assert tok.decode(ids) == out
    return ids


def chunked(ids: list[int], sizes) -> list[list[int]]:
    chunks, i, sizes = [], 0, iter(sizes)
    while i < len(ids):
        n = next(sizes)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def chunkings(n_ids: int, seed: int = 0):
    """Fixed chunk sizes 1-4 and random ones of 1-8 (what speculative decoding accepts)."""
    for size in (1, 2, 3, 4):
        yield f"size {size}", chunked(list(range(n_ids)), iter(lambda s=size: s, None))
    rng = random.Random(seed)
    for trial in range(20):
        yield f"random {trial}", chunked(list(range(n_ids)),
                                         iter(lambda: rng.randint(1, 8), None))


def check_streaming(tok, ids: list[int], skip: bool = True) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    for name, index_chunks in chunkings(len(ids)):
        d = IncrementalDetokenizer(tok, skip)
        deltas, pushed = [], []
        for chunk in index_chunks:
            pushed += [ids[i] for i in chunk]
            deltas.append(d.push([ids[i] for i in chunk]))
            # all complete characters are there: only a split one at the end may be missing
            assert d.text == tok.decode(pushed, skip_special_tokens=skip).rstrip("\ufffd"), name
            assert "".join(deltas) == d.text, name
        assert d.text == full, name


def test_cjk_text_streams_as_soon_as_its_characters_are_complete(tok):
    """CJK ids pushed in chunks of 1-4 and of random sizes: the text after every push is the
    decode of all ids less a trailing split character, and the deltas add up to the decode."""
    ids = completion_ids(tok, CJK, CJK_OUT)
    assert sum(tok.decode([i]).endswith("\ufffd") for i in ids) > len(ids) // 2
    check_streaming(tok, ids)
    check_streaming(tok, tok(CJK + CJK_OUT, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("skip", [True, False])
def test_byte_tokens_stream_as_soon_as_characters_are_complete(skip):
    """One byte per id (every multi-byte character split), with special tokens between bytes of a
    character: the same invariant, skipping special tokens or not."""
    bt = ByteTokenizer()
    ids = bt.encode("a 中文 b🙂c é")
    ids[4:4] = [ByteTokenizer.SPECIAL]                           # inside 中
    ids[-3:-3] = [ByteTokenizer.SPECIAL, ByteTokenizer.SPECIAL]
    check_streaming(bt, ids, skip)
    d = IncrementalDetokenizer(bt)
    assert d.push(bt.encode("ab中")[:3]) == "ab"                 # not held back for the split 中
    assert d.push(bt.encode("中")[1:]) == "中"


def run_stop(tok, ids: list[int], stop: str, sizes):
    rt = RequestText(tok, (stop,))
    text, kept, stopped = "", [], False
    for chunk in chunked(ids, sizes):
        k, t, stopped = rt.push(chunk, False)
        assert k == chunk[:len(k)]
        text, kept = text + t, kept + k
        if stopped:
            break
    return rt, text, kept, stopped


@pytest.mark.parametrize("stop", ["天", "安", "门。", "。我", "北京", "中文", "🙂"])
def test_cjk_stop_keeps_the_fewest_ids_in_chunks_of_three(tok, stop):
    """A stop string in CJK text pushed 3 ids at a time (and in random chunks): the text is cut
    before it, and the ids kept (returned, and counted as usage) are the fewest whose text
    contains it."""
    ids = completion_ids(tok, CJK, CJK_OUT)
    fewest = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    rng = random.Random(1)
    random_sizes = [iter(lambda: rng.randint(1, 8), None) for _ in range(10)]
    for sizes in [iter(lambda: 3, None), *random_sizes]:
        rt, text, kept, stopped = run_stop(tok, ids, stop, sizes)
        assert stopped and rt.finished
        assert text == CJK_OUT[:CJK_OUT.find(stop)]
        assert rt.num_tokens == len(kept) == fewest and kept == ids[:fewest]
        assert rt.detok.ids == kept


@pytest.mark.parametrize("boundary", [1, 2])
def test_ascii_stop_straddling_a_chunk_boundary(tok, boundary):
    """ASCII, unchanged: a stop string whose ids arrive in two pushes ends the request in the
    second, with the text before it and the ids through the token completing it."""
    ids = tok(ASCII, add_special_tokens=False)["input_ids"]
    stop = "brown fox jumps"
    fewest = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    split = fewest - boundary                   # the last `boundary` ids of the stop come later
    assert stop not in tok.decode(ids[:split])
    assert ASCII.find(stop) < len(tok.decode(ids[:split]))     # the first push has part of it
    rt = RequestText(tok, (stop,))
    k1, t1, s1 = rt.push(ids[:split], False)
    k2, t2, s2 = rt.push(ids[split:split + 4], False)
    assert (k1, s1) == (ids[:split], False) and s2 and rt.finished
    assert t1 + t2 == ASCII[:ASCII.find(stop)]
    assert k1 + k2 == ids[:fewest] and rt.num_tokens == fewest
    with pytest.raises(RuntimeError):
        rt.push(ids[split + 4:], False)


class LaggingDetokenizer(IncrementalDetokenizer):
    """Makes text only on every other push (as a detokenizer that held text back would)."""

    pushes = 0

    def push(self, new_ids):
        self.ids.extend(new_ids)
        self.pushes += 1
        if self.pushes % 2:
            return ""
        old, self.text = self.text, self.tok.decode(self.ids).rstrip("\ufffd")
        return self.text[len(old):]


def test_a_stop_completed_by_an_earlier_push_keeps_none_of_this_push():
    """Should a stop string show only after the push that completed it, none of this push's ids
    are kept: the ids returned, the usage and the text still agree."""
    bt = ByteTokenizer()
    ids = bt.encode("ab天安门")                                     # 天: ids 2-4
    rt = RequestText(bt, ("天",))
    rt.detok = LaggingDetokenizer(bt)
    assert rt.push(ids[:5], False) == (ids[:5], "", False)         # 天 complete, text not made
    kept, text, stopped = rt.push(ids[5:8], False)
    assert stopped and kept == [] and text == "ab"
    assert rt.num_tokens == 5 and rt.detok.ids == ids[:5] and rt.detok.text == "ab"
    assert rt._tokens_through(5, len("ab天")) == 5              # the fewest of all ids
    assert rt._tokens_through(4, len("ab天")) == 5
    assert rt._tokens_through(0, len("ab")) == 2


def one_at_a_time(tok, ids: list[int], stops: tuple[str, ...]) -> tuple[str, int]:
    """Plain decoding's result: ids pushed one by one, the first whose text holds a stop string
    ends it, cut at the earliest start among the stop strings that text holds."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n]).rstrip("\ufffd")
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            return text[:min(starts)], n
    return tok.decode(ids), len(ids)


@pytest.mark.parametrize("stops", [("quick brown fox jumps", "brown"), ("brown", "quick brown fox"),
                                   ("fox jumps over", "jumps", "over the lazy"),
                                   ("北京天安门", "天安"), ("。我爱北", "爱北京天")])
def test_several_stop_strings_end_where_one_id_at_a_time_would(tok, stops):
    """Two stop strings completed by one push (a step that accepted several tokens): the one
    completed first ends the request, as when ids come one at a time, not the one starting first
    -- so speculative and plain decoding stop at the same text and usage."""
    text = ASCII if stops[0].isascii() else CJK_OUT
    ids = tok(text, add_special_tokens=False)["input_ids"] if text is ASCII else \
        completion_ids(tok, CJK, CJK_OUT)
    want_text, want_n = one_at_a_time(tok, ids, stops)
    assert want_n < len(ids)
    for name, index_chunks in chunkings(len(ids)):
        rt = RequestText(tok, stops)
        out, kept = "", []
        for chunk in index_chunks:
            k, t, stopped = rt.push([ids[i] for i in chunk], False)
            out, kept = out + t, kept + k
            if stopped:
                break
        assert stopped and (out, len(kept)) == (want_text, want_n), name
        assert kept == ids[:want_n] and rt.num_tokens == want_n, name


def test_a_tokenizer_that_cleans_up_spaces_loses_no_text_in_the_stream(tok):
    """Tokenizers with ``clean_up_tokenization_spaces`` on (BERT/GPT-2 style configs, and every
    GGUF conversion under transformers 4.x) rewrite " ," to "," when decoding, i.e. change text
    before the window's end: the deltas dropped characters ("it ' s" lost its s). The stream
    decodes without clean-up, so it concatenates to the ids' text."""
    import copy

    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    # transformers 5 skips the clean-up for BPE unless forced (4.x did not): force it, as 4.x
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    text = "x = f(a , b) ; print('it ' s') ! ok . n't 're"
    ids = cleaning(text, add_special_tokens=False)["input_ids"]
    assert cleaning.decode(ids) != text                           # the clean-up is on
    for sizes in ([1], [2], [3, 1], [5]):
        d = IncrementalDetokenizer(cleaning)
        got = "".join(d.push(c) for c in chunked(ids, iter(sizes * len(ids))))
        assert got == text, sizes


def _sentencepiece_tokenizer():
    """A Llama-2 / Mistral-style tokenizer: Metaspace pieces, and their tokenizer.json decoder,
    which strips the leading space of the first token it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁of": 5, "▁France": 6,
             "▁is": 7, "▁Paris": 8, ".": 9, "▁Lyon": 10}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("chunks", [[[8, 9]], [[8], [9]]])
def test_the_first_word_keeps_its_space_after_the_prompt(chunks):
    """SentencePiece decoders strip the first decoded token's leading space: decoded alone, the
    completion of "The capital of France is" read "Paris." (prompt + completion no longer gave
    the text, a stop string starting with a space could not match). Decoded after the prompt's
    last tokens, as vLLM does, it reads " Paris."."""
    tok = _sentencepiece_tokenizer()
    prompt = [1, 3, 4, 5, 6, 7]
    text = RequestText(tok, prompt_ids=prompt)
    got = "".join(text.push(c, i == len(chunks) - 1)[1] for i, c in enumerate(chunks))
    assert got == " Paris."
    assert tok.decode(prompt, skip_special_tokens=True) + got \
        == tok.decode(prompt + [8, 9], skip_special_tokens=True)
    stop = RequestText(tok, (" Paris",), prompt_ids=prompt)
    assert stop.push([8, 9, 10], False) == ([8], "", True)          # found in the first token
    late = RequestText(tok)                                          # prompt given afterwards
    late.set_prompt(prompt)
    assert late.push([8, 9], True)[1] == " Paris."


def test_a_stop_token_counts_but_its_text_is_not_output(tok):
    """A request a stop id ended (``stop_token_ids``): the id is kept and counted (usage), its text
    is not in the output, as vLLM does with ``include_stop_str_in_output`` false (the default, and
    the one value the server accepts)."""
    ids = tok.encode(" sand Into the sea")
    text = RequestText(tok)
    first, rest = ids[:2], ids[2:]
    assert text.push(first, False)[1] == tok.decode(first)
    kept, delta, stopped = text.push(rest[:1], True, stop_id=True)
    assert kept == rest[:1] and delta == "" and not stopped
    assert text.num_tokens == 3 and text.detok.text == tok.decode(first)
    with pytest.raises(ValueError, match="stop_id"):
        RequestText(tok).push([5], False, stop_id=True)
