"""A request's text: incremental detokenisation and stop strings.

The engine's step produces token ids; it ends a request on a stop id or a length limit. Text is
made from the ids by one :class:`RequestText` per request, where the outputs are consumed:
:meth:`Engine.step` for the synchronous API (same thread, between steps), the event loop of
:class:`~dart_ray.engine.async_engine.AsyncEngine` for the server, off the engine's step loop, so
detokenising never delays a step. A stop string found in the text ends the request: the text is
cut before it, the token ids after the token that completes it, so token ids, usage and text agree.

:class:`IncrementalDetokenizer` decodes only a small window of new tokens per step. The window
starts at the tokens emitted in the previous chunk (``prefix_offset``) so that leading-space
handling matches decoding the whole sequence. When the window's decode ends in replacement
characters (a UTF-8 character split across byte-level tokens), the complete characters before
them are emitted at once (UTF-8 is self-synchronising: they do not change when the rest of the
split character arrives) and the window stays where it is until its decode no longer ends in one;
so after every push ``text == window(0, len(ids)).rstrip("\ufffd")`` (``decode(ids)``, after the
context below) and the text never lags the ids by
more than a split character. A stop string is thus found in the push whose ids complete it, and
the ids kept are the fewest whose text contains it.

**The prompt's last tokens are the first window's context** (:data:`CONTEXT_TOKENS`, as vLLM
primes its detokeniser with the prompt): a SentencePiece decoder (Llama-2, Mistral) strips the
leading space of the first token it decodes, so the output's first word would lose its space
(``"Paris."`` after ``"The capital of France is"``); with the context the first window's text
is ``decode(context + ids)`` past ``decode(context)`` (``" Paris."``). Byte-level BPE (SmolLM2,
Llama-3, Qwen) decodes the same either way.

**A stop token's text is not output** (vLLM's ``include_stop_str_in_output=false``, the default
and the only value the server takes): where a stop id (``stop_token_ids``, EOS) ended the request,
its id is kept (usage counts it) and its text is not (an EOS is a special token, skipped anyway).
"""

from __future__ import annotations

CONTEXT_TOKENS = 5
"""Prompt tokens the first window is decoded after (vLLM's initial detokenisation offset)."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.context: list[int] = []
        """Prompt tokens the first window is decoded after (:meth:`set_context`)."""
        self._context_len: int | None = 0
        """Characters of ``decode(context)`` (None: not measured yet)."""
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.window_emitted = 0
        """Characters of the current window (past its ``prefix_offset:read_offset`` part) already
        emitted while its decode ended in a split character."""
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        # no clean-up: it rewrites text before the window's end (" ," -> ","; a BERT/GPT-2 style
        # tokenizer, or transformers 4.x's converted ones, turn it on), so deltas would drop text
        return self.tok.decode(ids, skip_special_tokens=self.skip,
                               clean_up_tokenization_spaces=False)

    def set_context(self, prompt_ids: list[int]) -> None:
        """Decode the first window after the prompt's last :data:`CONTEXT_TOKENS` tokens (before
        any :meth:`push`; nothing is decoded here, so the engine thread may call it)."""
        if self.ids:
            raise RuntimeError("set_context after the first push")
        self.context, self._context_len = list(prompt_ids[-CONTEXT_TOKENS:]), None

    def _settle_context(self) -> None:
        """At the first push: drop context tokens that end in a split UTF-8 character (the output
        would complete it, changing the text before the output) and measure the rest."""
        if self._context_len is None:
            while self.context and self._decode(self.context).endswith("\ufffd"):
                self.context.pop()
            self._context_len = len(self._decode(self.context))

    def window(self, start: int, end: int) -> str:
        """Text of ``ids[start:end]``; the first window (``start == 0``) after the context."""
        if start or not self.context:
            return self._decode(self.ids[start:end])
        return self._decode(self.context + self.ids[:end])[self._context_len:]

    def push(self, new_ids: list[int]) -> str:
        """Append token ids; return the newly readable text (possibly empty)."""
        self._settle_context()
        self.ids.extend(new_ids)
        prefix = self.window(self.prefix_offset, self.read_offset)
        full = self.window(self.prefix_offset, len(self.ids))
        start = len(prefix) + self.window_emitted
        if full.endswith("\ufffd"):
            # a split character at the end: emit what precedes it, keep the window where it is
            delta = full.rstrip("\ufffd")[start:]
            self.window_emitted += len(delta)
        elif len(full) > len(prefix):
            delta = full[start:]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.window_emitted = 0
        else:
            return ""
        self.text += delta
        return delta


class RequestText:
    """The text of one request's output, step by step: ids in, (ids kept, new text) out.

    Text that may be the start of a stop string is held back until it cannot be; the rest is
    returned as soon as it is readable. After the request ends (:attr:`finished`) nothing more may
    be pushed."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, prompt_ids: list[int] | None = None) -> None:
        """``prompt_ids``: the request's prompt, the first window's context (or later, before the
        first push: :meth:`set_prompt`)."""
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        if prompt_ids:
            self.detok.set_context(prompt_ids)
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self._hold = max(self._longest - 1, 0)   # characters that may start a stop string
        self.emitted = 0
        """Characters of ``detok.text`` returned so far."""
        self.finished = False
        self._stop_id = 0
        """1 once a stop token ended the request: an id kept beyond the decoded ones."""

    def set_prompt(self, prompt_ids: list[int]) -> None:
        """The request's prompt, known after construction (before the first push)."""
        self.detok.set_context(prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Token ids kept so far (the request's usage)."""
        return len(self.detok.ids) + self._stop_id

    def push(self, ids: list[int], finished: bool,
             stop_id: bool = False) -> tuple[list[int], str, bool]:
        """Add one step's ``ids`` (``finished``: the engine ended the request with them;
        ``stop_id``: it ended it on a stop token id, the last of ``ids``, whose text is left out)
        -> (the ids kept, the new text, whether a stop string ended the request here: then only the
        ids through the token that completes it are kept)."""
        if self.finished:
            raise RuntimeError("RequestText.push after the request finished")
        if stop_id and not (finished and ids):
            raise ValueError("stop_id needs the finishing push and its stop token")
        d = self.detok
        before = len(d.ids)
        d.push(ids[:-1] if stop_id else ids)
        text = d.text
        stopped = False
        if self.stop:
            lo = max(0, self.emitted - self._longest)
            hits = [(i, i + len(s)) for i, s in ((text.find(s, lo), s) for s in self.stop)
                    if i >= 0]
            if hits:
                # as if the ids came one at a time: the first id to complete a stop string ends
                # the request, and of the stop strings its text holds, the earliest start cuts
                # (so the result does not depend on how many ids one step accepted)
                n = self._tokens_through(before, min(end for _, end in hits))
                reach = self._text_len(n)
                cut = min(i for i, end in hits if end <= reach)
                d.text = text = text[:cut]
                # ids of earlier pushes were returned already: those stay, only this push's shrink
                keep = max(n - before, 0)
                del d.ids[before + keep:]
                ids, stopped = ids[:keep], True
        self._stop_id = int(stop_id and not stopped)       # kept (and counted), not decoded
        self.finished = finished or stopped
        upto = len(text) if self.finished else max(self.emitted, len(text) - self._hold)
        delta = text[self.emitted:upto]
        self.emitted = upto
        return ids, delta, stopped

    def _tokens_through(self, before: int, end: int) -> int:
        """The fewest of all ids whose text reaches ``end`` characters (the token that completes a
        stop string is the last one kept); ``before``: the ids pushed before this push.

        The text of every push is readable at once (:class:`IncrementalDetokenizer`), so a stop
        string found now was completed by this push's ids: the search starts there. Should the
        text of the earlier ids already reach ``end``, the fewest ids are found among them."""
        d = self.detok

        def reaches(n: int) -> bool:
            return self._text_len(n) >= end

        if reaches(before):                         # completed by earlier ids: bisect them
            lo, hi = 0, before                      # not reaches(lo - 1); reaches(hi)
            while lo < hi:
                mid = (lo + hi) // 2
                if reaches(mid):
                    hi = mid
                else:
                    lo = mid + 1
            return lo
        for n in range(before + 1, len(d.ids)):
            if reaches(n):
                return n
        return len(d.ids)

    def _text_len(self, n: int) -> int:
        """Characters readable from the first ``n`` ids (a split UTF-8 character is not there
        yet)."""
        return len(self.detok.window(0, n).rstrip("\ufffd"))
