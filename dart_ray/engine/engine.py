"""The engine: continuous batching over one decode step that reads as its phases.

    step():
        admit()    new requests take free rows: one batched target prefill, first token sampled
        draft()    drafter.propose -> a token tree per running row (root = last bonus token)
        verify()   one target forward over [root, tree] with tree attention (+ taps)
        accept()   greedy or lossless sampling acceptance -> path + bonus per row
        commit()   keep the accepted path's KV, feed its taps to the drafter
        emit()     append tokens, stop checks, stream deltas, free finished rows

Rows of the static KV cache are compacted: running requests always occupy rows ``0..B-1``, so
each forward works on a contiguous slice of the cache (no gathers). Plain AR is the same loop
with the ``none`` drafter (root-only trees), so speedups are measured against the same code path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from dart_ray.config import DecodingConfig, EngineConfig, SamplingParams
from dart_ray.drafters.base import BatchView, Drafter
from dart_ray.engine.controller import ContextualController, ladder_upto
from dart_ray.engine.cost import TOKEN_GRID, CostModel, batch_grid, load_or_measure
from dart_ray.engine.detok import RequestText
from dart_ray.engine.hindsight import Hindsight, HindsightStep
from dart_ray.engine.metrics import EngineStats
from dart_ray.engine.request import Completion, Request, RequestOutput
from dart_ray.hardware import DTypeChoice, Fingerprint, synchronize
from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.models.loading import LoadedTarget
from dart_ray.profiles import DecodingSchedule
from dart_ray.tree import TokenTree, empty_tree
from dart_ray.verify import RequestRandom, accept
from dart_ray.verify.logits import NodeLogits

log = logging.getLogger(__name__)

PromptLike = str | list[int] | list[dict]

MIN_TREE_SCRATCH = 64
"""Cache slots reserved beyond ``max_model_len`` for the draft tree (at least this many, so a
profile loaded later can use trees of this size). Trees are capped to the reserve, never the
request."""


@functools.lru_cache(maxsize=256)
def _first_nodes_knobs(decoding: DecodingConfig, n: int) -> DecodingConfig:
    """The knobs of a budget-``n`` search, whose tree is the first ``n`` nodes of the full one:
    no deeper than ``n`` levels, and no more than ``n`` beams (a selected node's parent is among
    the best ``n`` of its level, so beams ranked below ``n`` only add expansions, each an N-gram
    lookup; exact wherever path scores do not rise, i.e. up to ``eps``-sized ties).
    Cached: the controller picks among a few ladder sizes, so a step reuses one of a few configs
    instead of building and validating a new one."""
    return decoding.replace(tree_budget=min(decoding.tree_budget, n),
                            draft_depth=min(decoding.draft_depth, n),
                            beam_width=min(decoding.beam_width, n))


class InvalidPromptError(ValueError):
    """The prompt cannot be generated from: empty, token ids outside the vocabulary, or too long
    (:class:`PromptTooLongError`)."""


class PromptTooLongError(InvalidPromptError):
    """The prompt does not fit the context."""


def encode_prompt(tokenizer, prompt: PromptLike, chat: bool = False,
                  add_special_tokens: bool | None = None) -> list[int]:
    """Text (optionally through the chat template), chat messages, or token ids -> ids.

    ``add_special_tokens``: whether the tokenizer adds its special tokens (a Llama tokenizer's
    BOS) around the text. None = as Hugging Face and vLLM do by default: yes for plain text (the
    model saw BOS in training), no for a chat template (the template writes them). Token ids are
    taken as they are."""
    if isinstance(prompt, str) and not chat:
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens is not False)
                    ["input_ids"])
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=bool(add_special_tokens))["input_ids"])
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise TypeError("prompt must be a non-empty string, a list of chat messages, or a list of "
                    "token ids")


class _Stream:
    """What :meth:`Engine.stream` returns: an iterator over the outputs that, when closed or
    garbage-collected -- also before its first ``next`` -- closes its stream in the engine."""

    def __init__(self, gen: Iterator[RequestOutput], close: Callable[[list[str]], None],
                 ids: list[str]) -> None:
        self._gen = gen
        self._finalizer = weakref.finalize(self, close, list(ids))

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> RequestOutput:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        self._finalizer()


def one_delta_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """A step's deltas with one per request, in first-seen order: a request admitted in a step is
    decoded in it too (its prefill token, then its first decode's), and a consumer that times
    deltas (inter-token latency) must not see a 0 s gap between two halves of one step."""
    merged: list[RequestOutput] = []
    open_at: dict[str, int] = {}      # request id -> index of its unfinished delta in merged
    for o in outputs:
        i = open_at.get(o.request_id)
        if i is None:                 # never into a finished delta (a reused id is a new request)
            i = open_at[o.request_id] = len(merged)
            merged.append(o)
        else:
            first = merged[i]
            merged[i] = dataclasses.replace(o, new_token_ids=first.new_token_ids + o.new_token_ids,
                                            new_text=first.new_text + o.new_text)
        if merged[i].finished:
            del open_at[o.request_id]
    return merged


class Engine:
    def __init__(self, target: LoadedTarget, drafter: Drafter, config: EngineConfig,
                 cost_model: CostModel | None = None,
                 dtype_choice: DTypeChoice | None = None) -> None:
        """``cost_model``: the verify cost model to use (None = measure it, or load it from the
        hardware cache; tests pass synthetic ones). ``dtype_choice``: how ``config.dtype`` was
        resolved (:meth:`from_config` passes it)."""
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.config = config
        self.drafter = drafter
        self.schedule = DecodingSchedule.constant(config.decoding)
        """The decoding knobs by batch size, read every step (:meth:`decoding_for`): a constant
        schedule of ``config.decoding``, or the loaded profile's (:meth:`set_decoding`)."""
        self.device = self.model.embed.weight.device
        self.dtype = self.model.embed.weight.dtype
        dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16",
                      torch.float16: "fp16"}[self.dtype]
        self.dtype_choice = dtype_choice or DTypeChoice(dtype_name, config.dtype, "given")
        self.fingerprint = Fingerprint.current(self.device, dtype_name, target.model_id,
                                               config.num_threads)
        # what a request can use (prompt + generated); the draft-tree scratch lies beyond it
        self.scratch = drafter.max_tree_nodes(config.decoding)
        if self.scratch > 0:
            self.scratch = max(self.scratch, MIN_TREE_SCRATCH)
        self.max_model_len = config.max_seq_len
        if config.max_seq_len > target.args.max_position_embeddings:
            log.warning("max_seq_len %d exceeds the model's max_position_embeddings %d: positions "
                        "beyond it were never trained (the output may degrade there)",
                        config.max_seq_len, target.args.max_position_embeddings)
        window = target.args.sliding_window
        if window and window + 1 < self.max_model_len:
            # attention has no sliding window: stay inside it. The last token of a request of
            # window + 1 comes from position window - 1, which sees every key; tree nodes beyond
            # it only predict tokens past the end, which are never emitted
            log.info("max_seq_len %d -> %d: the model's sliding window is %d",
                     self.max_model_len, window + 1, window)
            self.max_model_len = window + 1
        self.max_seq_len = self.max_model_len
        capacity = self.max_model_len + self.scratch + 1
        self.max_batch = config.max_batch_size
        self.cache = self.model.new_cache(self.max_batch, capacity)
        self.tokens = np.zeros((self.max_batch, capacity), dtype=np.int64)  # committed ids per row
        self.drafter.allocate(self.max_batch, capacity)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, deque[RequestOutput]] = {}
        """Request id -> the output queue of the open :meth:`stream` (or :meth:`generate`) that
        owns it: a step, whichever stream runs it, queues each output there."""
        self._unclaimed: list[RequestOutput] = []
        """Outputs of requests no stream owns (added with :meth:`add_request`) from steps a
        stream ran: the next :meth:`step` returns them first."""
        self.metrics = EngineStats()
        self.eos_ids = frozenset(self._eos_ids())
        self._maybe_pack(config.pack_weights)
        self.controller: ContextualController | None = None
        self.hindsight = Hindsight()
        if config.adaptive and self.scratch > 0:
            self.controller = ContextualController(cost_model or self._measured_cost_model())

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, cost_model: CostModel | None = None) -> Engine:
        """Load target, drafter and N-gram model as the config says (weights load once here).

        ``dtype="auto"`` is resolved first (:func:`dart_ray.hardware.resolve_dtype`); the engine's
        ``config`` carries the concrete dtype and ``dtype_choice`` says why."""
        from dart_ray.drafters import make_drafter
        from dart_ray.hardware import resolve_dtype
        from dart_ray.models import load_target

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        choice = resolve_dtype(config.dtype, config.device)
        config = config.replace(dtype=choice.dtype)
        target = load_target(config.model, config.dtype, config.device, config.max_seq_len)
        drafter = make_drafter(config, target)
        engine = cls(target, drafter, config, cost_model=cost_model, dtype_choice=choice)
        log.info("engine: %s (%s, dtype %s: %s)", config.method, engine.fingerprint.summary(),
                 choice.dtype, choice.reason)
        return engine

    def _measured_cost_model(self) -> CostModel:
        """Verify cost on this machine for the grid of batch sizes x tree sizes: cached per
        fingerprint, else measured now (a few seconds for SmolLM2 on 2 cores)."""
        cap = self.cache.max_seq_len
        ctx = min(128, cap // 4)
        tokens = [t for t in TOKEN_GRID if t <= self.scratch + 1 and ctx + t <= cap]
        bigger = [t for t in TOKEN_GRID if t > self.scratch + 1 and ctx + t <= cap]
        tokens += bigger[:1]                                   # one point beyond, for interpolation
        batches = batch_grid(self.max_batch)
        fp = self.fingerprint.to_dict()
        tp = getattr(getattr(self.model, "tp", None), "world_size", 1)
        key = (f"{self.fingerprint.key()}-b{batches[-1]}-t{tokens[-1]}-p{int(self.packed)}-tp{tp}"
               f"-taps{len(self.drafter.taps)}")
        return load_or_measure(key, fp, lambda B, T: self._timing_forward(B, T, ctx), batches,
                               tokens)

    def _timing_forward(self, B: int, T: int, ctx: int) -> None:
        """A verify-shaped forward over rows 0..B-1 (``ctx`` slots of context, ``T`` new tokens,
        taps, the LM head on half the nodes); nothing is committed."""
        dev = self.device
        starts = [ctx] * B
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        positions = (ctx + torch.arange(T, device=dev)).expand(B, T)
        mask = attention_mask(starts, causal_ancestors(T, dev), ctx + T,
                              self.dtype) if T > 1 else None
        out = self.model(tokens, positions, mask, self.cache, rows=slice(0, B), starts=starts,
                         taps=self.drafter.taps, return_logits=False)
        self.model.head(out.hidden[:, : (T + 1) // 2])
        synchronize(self.device)

    def _maybe_pack(self, pack: bool | None) -> None:
        from dart_ray.models.packing import (
            WARM_ROWS,
            PackedLinear,
            pack_linears,
            packing_available,
            packing_supported,
            warm_packed,
        )

        local = isinstance(self.model, torch.nn.Module)
        if pack and not (local and packing_available(self.device, self.dtype)):
            raise ValueError("pack_weights=True needs a local (not TP-proxied) model on CPU in "
                             f"fp32, or in bf16 with oneDNN bf16 support (device {self.device}, "
                             f"dtype {self.dtype})")
        if pack is None:                 # auto: where it is measured to help on this machine
            pack = local and packing_supported(self.device, self.dtype)
        if not pack and isinstance(self.model, torch.nn.Module) and any(
                isinstance(m, PackedLinear) for m in self.model.modules()):
            raise ValueError("pack_weights=False, but this target was already packed in place by "
                             "another engine; load a separate target for an unpacked engine")
        if pack:
            pack_linears(self.model)
            self.drafter.pack_weights()
            mods = [m for m in (self.model, getattr(self.drafter, "model", None))
                    if isinstance(m, torch.nn.Module)]
            # no step meets a kernel not built yet (and is timed at that): every row count up to
            # a bs-1 verify of the largest tree
            warm_packed(mods, range(1, max(WARM_ROWS, self.scratch + 1) + 1))
        self.packed = bool(pack)
        """Whether the target's linears are oneDNN-prepacked (part of the cost model's cache
        key)."""

    def _eos_ids(self) -> set[int]:
        ids = set(self.target.args.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ---- runtime knobs ------------------------------------------------------------------------
    def set_decoding(self, decoding: DecodingConfig | DecodingSchedule) -> None:
        """Swap runtime knobs: a DecodingSchedule (a profile), or one DecodingConfig for every batch
        size (held as a constant schedule)."""
        if isinstance(decoding, DecodingConfig):
            decoding = DecodingSchedule.constant(decoding)
        if not isinstance(decoding, DecodingSchedule):
            raise TypeError("expected a DecodingConfig or a DecodingSchedule, got "
                            f"{type(decoding).__name__}")
        self.schedule = decoding
        if self.controller is not None:
            self.controller.reset_acceptance()   # other knobs, other trees: learn acceptance again
            self.hindsight = Hindsight()         # and nothing from the old trees' walks

    def decoding_for(self, batch_size: int) -> DecodingConfig:
        """The knobs a step of ``batch_size`` rows uses."""
        return self.schedule.for_batch_size(batch_size)

    # ---- requests -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptLike, chat: bool = False,
                      add_special_tokens: bool | None = None) -> list[int]:
        """Text (optionally through the chat template), chat messages, or token ids -> ids
        (:func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, chat, add_special_tokens)

    def check_prompt(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise InvalidPromptError("prompt is empty")
        V = self.target.args.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise InvalidPromptError(f"prompt token ids must be in [0, {V})")
        limit = self.max_model_len - 1
        if len(ids) > limit:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context allows at most {limit} "
                f"(max_model_len {self.max_model_len}, at least one token to generate)")

    def add_request(self, prompt: PromptLike, params: SamplingParams | None = None,
                    request_id: str | None = None, chat: bool = False) -> str:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (or None), got "
                            f"{type(params).__name__}")
        ids = self.encode_prompt(prompt, chat)
        self.check_prompt(ids)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if any(o.request_id == rid for o in self._unclaimed):
            raise ValueError(f"request id {rid!r} has outputs the next step() returns: step first")
        rand = None if params.greedy else RequestRandom(params.seed, device=self.device)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        req = Request(request_id=rid, prompt_ids=ids, params=params, random=rand,
                      stop_ids=frozenset(stop_ids))
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (None if unknown or already finished)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        req.finished, req.finish_reason = True, "abort"
        if req in self.waiting:
            self.waiting.remove(req)
        if req.row >= 0:
            self._release([req])
        self.requests.pop(request_id, None)
        # outputs a stream's steps made for it and no step() returned yet: in its final output
        held = [o for o in self._unclaimed if o.request_id == request_id]
        if held:
            self._unclaimed = [o for o in self._unclaimed if o.request_id != request_id]
        out = self._output(req, [t for o in held for t in o.new_token_ids],
                           "".join(o.new_text for o in held))
        if request_id in self._streams:        # an open stream owns it: it ends with this output
            self._streams[request_id].append(out)
        return out

    def has_unfinished(self) -> bool:
        """Requests wait or run, or outputs wait for the next :meth:`step` (a stream's steps ran
        requests added with :meth:`add_request`)."""
        return bool(self.waiting or self.running or self._unclaimed)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        """One engine step: admit waiting requests (prefill) and decode the running ones; returns
        each request's delta.

        ``detokenize``: the deltas carry their text, and stop strings end requests here (the
        synchronous API). False: token ids only (``new_text`` empty), the step ends requests on
        stop ids and length limits only; the consumer makes the text and applies stop strings
        with a :class:`~dart_ray.engine.detok.RequestText` per request, off this step loop, and
        aborts a request a stop string ended (:class:`~dart_ray.engine.AsyncEngine` does)."""
        outputs: list[RequestOutput] = []
        admitted = bool(self.waiting) and len(self.running) < self.max_batch
        try:
            if admitted:
                self._admit(outputs, detokenize)
            if self.running:
                self._decode(outputs, detokenize)
        except BaseException:
            # a step that failed part-way may have committed KV entries and tokens for rows whose
            # requests never saw them: decoding on would be silently wrong, so every request ends
            # (``abort``; an open stream gets its final output) and the engine is clean again
            self._abort_all()
            raise
        if self._unclaimed:          # what steps a stream ran made for add_request's requests
            outputs, self._unclaimed = self._unclaimed + outputs, []
        elif not admitted:           # a decode-only step has one delta per request already
            return outputs
        return one_delta_per_request(outputs)

    def _abort_all(self) -> None:
        for rid in list(self.requests):
            try:
                out = self.abort(rid)
                if out is not None and rid not in self._streams:
                    self._unclaimed.append(out)    # an add_request's: the next step() ends it
            except Exception:  # noqa: BLE001 - the others must still end
                log.exception("abort of %s after a failed step failed", rid)

    def _admit(self, outputs: list[RequestOutput], detokenize: bool) -> None:
        t0 = time.perf_counter()
        n = min(self.max_batch - len(self.running), len(self.waiting))
        new = [self.waiting.popleft() for _ in range(n)]
        r0 = len(self.running)
        rows = slice(r0, r0 + n)
        lens = [len(r.prompt_ids) for r in new]
        T = max(lens)
        dev = self.device
        tokens = torch.zeros(n, T, dtype=torch.long)
        for i, r in enumerate(new):
            tokens[i, :lens[i]] = torch.tensor(r.prompt_ids)
            self.cache.reset_row(r0 + i)
            self.tokens[r0 + i, :lens[i]] = r.prompt_ids
        tokens = tokens.to(dev)
        positions = torch.arange(T, device=dev).expand(n, T)
        # right-padded prompts from slot 0: plain causal (pad keys sit after every real query)
        mask = attention_mask([0] * n, causal_ancestors(T, dev), T, self.dtype) if T > 1 else None
        last = torch.tensor(lens, device=dev).sub(1).view(n, 1)              # [n, 1]
        out = self.model(tokens, positions, mask, self.cache, rows=rows, starts=[0] * n,
                         taps=self.drafter.taps, logits_at=last)
        self.cache.commit_all(rows, lens)
        acc = self._accept(empty_tree(tokens.gather(1, last).view(n)), out.logits, new)
        first = acc.bonus.tolist()
        for i, r in enumerate(new):
            r.row = r0 + i
            r.root = first[i]
            self.running.append(r)
            self.metrics.prompt_tokens += lens[i]
        pad = torch.zeros(n, 1, dtype=torch.long, device=dev)
        nxt = torch.cat([tokens[:, 1:], pad], dim=1)                          # [n, T]
        nxt[torch.arange(n, device=dev), last.view(n)] = acc.bonus
        self.drafter.prefill(rows, lens, out.taps, nxt)
        self.metrics.prefill_s += time.perf_counter() - t0
        finished = []
        for i, r in enumerate(new):
            if self._emit(r, [first[i]], outputs, detokenize):
                finished.append(r)
        if finished:
            self._release(finished)

    def _decode(self, outputs: list[RequestOutput], detokenize: bool) -> None:
        m = self.metrics
        reqs = self.running
        B = len(reqs)
        dev = self.device
        decoding = self.decoding_for(B)
        max_nodes = min(self.drafter.max_tree_nodes(decoding), self.scratch)
        t0 = time.perf_counter()
        tree_before = self.drafter.tree_time_s
        roots = torch.tensor([r.root for r in reqs], dtype=torch.long, device=dev)
        view = BatchView(roots=roots, lengths=self.cache.lengths[:B], tokens=self.tokens,
                         decoding=decoding, params=[r.params for r in reqs],
                         randoms=[r.random for r in reqs])
        context: tuple[int, bool] = (0, False)                                # plan
        if self.controller is None:
            n = max_nodes
        else:
            if max_nodes > 0:
                # what the drafter tells (lookup: the suffix match), and whether every row is in a
                # run whose earlier path went on past its cut (copying text: it tends to go on)
                context = (self.drafter.context(view),
                           all(self.hindsight.running(r.request_id) for r in reqs))
            t_ctx = time.perf_counter()
            n = self.controller.plan(B, max_nodes, context)
            t0 += time.perf_counter() - t_ctx      # planning is not drafting: the clock skips it
        if n > 0:
            if n < max_nodes:            # a small tree: the first n nodes of a budget-n search
                view.full_decoding, view.decoding = decoding, _first_nodes_knobs(decoding, n)
                view.max_nodes = n
            full = self.drafter.propose(view)                                  # draft + tree search
            tree = full.truncate(n)
        else:
            full = tree = empty_tree(roots)                                    # a plain AR step
            m.ar_steps += 1
        t1 = time.perf_counter()
        tree_dt = self.drafter.tree_time_s - tree_before
        m.draft_s += (t1 - t0) - tree_dt
        m.tree_s += tree_dt

        logits, taps = self._verify(tree)                                       # one target forward
        t2 = time.perf_counter()
        m.verify_s += t2 - t1

        acc = self._accept(tree, logits, reqs)                            # path + bonus
        # per row, in one copy to the host: committed tokens (root + accepted drafts), the bonus
        # token, draft nodes verified, speculated positions
        num_committed, bonus, n_draft, depth = torch.stack([
            acc.num_accepted + 1, acc.bonus, tree.valid.sum(1) - 1,
            tree.depths.masked_fill(~tree.valid, 0).amax(1)]).tolist()
        path_tokens = self._commit(tree, acc, taps, num_committed, view)  # [B][d+1] ids on the path
        m.head_rows += logits.head_rows
        t3 = time.perf_counter()
        m.accept_s += t3 - t2

        m.steps += 1                                                      # emit
        finished = []
        for b, r in enumerate(reqs):
            k = num_committed[b] - 1
            r.stats.record(n_draft[b], k)
            m.record_row(n_draft[b], k, depth[b])
            r.root = bonus[b]
            new_ids = path_tokens[b][1:k + 1] + [bonus[b]]
            if self.controller is not None:      # earlier steps' paths past their cut go on
                self._learn(self.hindsight.feed(r.request_id, new_ids))
            if self._emit(r, new_ids, outputs, detokenize):
                finished.append(r)
        known, now = n, None      # budgets this step teaches; its paths, if known already
        if self.controller is not None and n > 0:
            paths = [p[1:k] for p, k in zip(acc.path.tolist(), num_committed, strict=True)]
            known = self._known(view, n, max_nodes)
            step = self.hindsight.begin(context, known, n, full, paths, bonus,
                                        [r.request_id for r in reqs])
            now = step.paths if step.done else None      # else learned when the paths end
        if finished:
            self._release(finished)
        t4 = time.perf_counter()
        m.other_s += t4 - t3
        if self.controller is not None:
            # a plain step's context (its lookups) is overhead; a speculative step's, drafting --
            # unless the drafter also took a new row's prompt in it (a catch-up, not a step's cost)
            self.controller.record(B, n, now, draft_s=t1 - t0, verify_s=t2 - t1,
                                   tokens_per_row=tree.num_nodes,
                                   overhead_s=t4 - t2 + (t1 - t0 if n == 0 else 0.0),
                                   context=context, known=known, full_width=full.num_nodes - 1,
                                   catch_up=n > 0 and self.drafter.caught_up)

    @staticmethod
    def _known(view: BatchView, n: int, max_nodes: int) -> int:
        """The largest ladder budget (<= ``max_nodes``) whose tree is the first nodes of every
        row's uncut tree this step (the drafter's ``exact_nodes``), at least the ``n`` verified."""
        if view.exact_nodes is None or n >= max_nodes:
            return n
        k = min(min(view.exact_nodes), max_nodes)
        return max([n] + [s for s in ladder_upto(max_nodes) if s <= k])

    def _learn(self, steps: list[HindsightStep]) -> None:
        """Steps whose paths past the cut have ended: the controller learns their acceptance."""
        for s in steps:
            self.controller.learn(s.context, s.paths, s.known)

    def _verify(self, tree: TokenTree) -> tuple[NodeLogits, torch.Tensor | None]:
        """One target forward over [root, tree]; the LM head only where acceptance can use it."""
        B, T = tree.tokens.shape
        starts = self.cache.lengths[:B]
        positions = torch.tensor(starts, device=self.device)[:, None] + tree.depths   # [B, 1+N]
        if T == 1 and all(s == starts[0] for s in starts):
            mask = None  # one new token per row, equal lengths: it sees every committed slot
        else:
            mask = attention_mask(starts, tree.ancestors(), max(starts) + T, self.dtype)
        out = self.model(tree.tokens, positions, mask, self.cache, rows=slice(0, B), starts=starts,
                         taps=self.drafter.taps, return_logits=False)
        return NodeLogits.lazy(tree, out.hidden, self.model.head), out.taps

    def _accept(self, tree: TokenTree, logits: torch.Tensor | NodeLogits, reqs: list[Request]):
        # the token after each root is output position len(output_ids) (the root is in them)
        return accept(tree, logits, [r.params for r in reqs], [r.random for r in reqs],
                      [len(r.output_ids) for r in reqs])

    def _commit(self, tree: TokenTree, acc, taps, num_committed: list[int],
                view: BatchView) -> list[list[int]]:
        """Keep the accepted paths' KV, record their tokens, feed the drafter; returns the path
        tokens."""
        B = tree.batch_size
        dev = tree.tokens.device
        starts = list(self.cache.lengths[:B])
        path = acc.path.clamp(min=0)                                         # [B, d+1] node indices
        self.cache.commit(slice(0, B), path, num_committed)
        path_tokens = torch.gather(tree.tokens, 1, path)                     # [B, d+1]
        toks = path_tokens.tolist()
        for b in range(B):
            n = num_committed[b]
            self.tokens[b, starts[b]:starts[b] + n] = toks[b][:n]
        # what follows each committed position: the next accepted draft, then the new root (bonus)
        A = max(num_committed)
        nxt = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)[:, :A].clone()  # [B, A]
        nxt[torch.arange(B, device=dev), acc.num_accepted] = acc.bonus
        tap_sel = None
        if self.drafter.taps:
            idx = path[:, :A, None].expand(-1, -1, taps.shape[-1])
            tap_sel = torch.gather(taps, 1, idx)                                 # [B, A, nT*H]
        view.lengths = self.cache.lengths[:B]
        self.drafter.observe(view, num_committed, tap_sel, nxt)
        return toks

    # ---- emission / stop conditions ---------------------------------------------------------
    def _emit(self, r: Request, new_ids: list[int], outputs: list[RequestOutput],
              detokenize: bool) -> bool:
        """Append tokens to ``r`` honouring stop conditions; stream a delta. True if finished.

        Token ids, usage and text agree for every finish reason: tokens after a stop id, after
        ``max_new_tokens``, past ``max_model_len``, or (``detokenize``) after the token that
        completes a stop string are dropped (a step may have accepted several)."""
        p = r.params
        kept: list[int] = []
        reason = None
        for t in new_ids:
            kept.append(t)
            if t in r.stop_ids:
                reason = "stop"
                break
            if len(r.output_ids) + len(kept) >= p.max_new_tokens or \
                    len(r.prompt_ids) + len(r.output_ids) + len(kept) >= self.max_model_len:
                reason = "length"
                break
        text = ""
        if detokenize:
            if r.text is None:
                r.text = RequestText(self.tokenizer, p.stop, prompt_ids=r.prompt_ids)
            # reason "stop" here is a stop id (stop strings are the text's): its text is left out
            kept, text, stopped = r.text.push(kept, reason is not None, stop_id=reason == "stop")
            if stopped:
                reason = "stop"
        r.output_ids += kept
        self.metrics.generated_tokens += len(kept)
        if reason:
            r.finished, r.finish_reason = True, reason
        outputs.append(self._output(r, kept, text))
        return r.finished

    def _output(self, r: Request, ids: list[int], text: str) -> RequestOutput:
        return RequestOutput(request_id=r.request_id, new_token_ids=ids, new_text=text,
                             finished=r.finished, finish_reason=r.finish_reason,
                             num_prompt_tokens=len(r.prompt_ids),
                             num_generated_tokens=len(r.output_ids), stats=r.stats)

    def _release(self, reqs: Iterable[Request]) -> None:
        """Free the rows of finished requests, compacting the running block to rows 0..B-1."""
        for r in sorted(reqs, key=lambda q: q.row, reverse=True):
            row, last = r.row, len(self.running) - 1
            if row != last:
                moved = self.running[last]
                self.cache.move_row(last, row)
                self.drafter.move_row(last, row)
                n = self.cache.lengths[row]
                self.tokens[row, :n] = self.tokens[last, :n]
                self.running[row] = moved
                moved.row = row
            self.running.pop()
            if self.controller is not None:
                self._learn(self.hindsight.end(r.request_id))
            self.cache.reset_row(last)
            self.drafter.release_row(last)
            r.row = -1
            self.metrics.finished_requests += 1
            self.requests.pop(r.request_id, None)

    # ---- convenience: streaming is the one path; generate drains it ----------------------------
    def _add_all(self, prompts, params, chat: bool) -> list[str]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], (int, dict)))
        plist = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(plist)
        elif not isinstance(params, (list, tuple)):
            raise TypeError(f"params must be a SamplingParams, a list of them or None, got "
                            f"{type(params).__name__}")
        if len(params) != len(plist):
            raise ValueError(f"{len(params)} SamplingParams for {len(plist)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(plist, params, strict=True):
                ids.append(self.add_request(p, sp, chat=chat))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves no orphan requests behind
                self.abort(rid)
            raise
        return ids

    def _drain(self, ids: list[str]) -> _Stream:
        """Step until ``ids`` finish, yielding their outputs. Streams may interleave (two
        iterators consumed in turns): each open stream has one queue, and a step, whoever runs it,
        hands every open stream its outputs in order. Closing the stream, or dropping it (even
        before its first ``next``), aborts what it has not finished."""
        queue: deque[RequestOutput] = deque()
        for rid in ids:                  # now, not at the first next(): steps may run before it
            self._streams[rid] = queue
        return _Stream(self._drain_registered(ids, queue), self._close_stream, ids)

    def _close_stream(self, ids: list[str]) -> None:
        for rid in ids:
            self._streams.pop(rid, None)
        for rid in ids:                  # unfinished ones: do not leak rows (no-op if finished)
            self.abort(rid)

    def _drain_registered(self, ids: list[str],
                          queue: deque[RequestOutput]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                if not queue:
                    if not any(rid in self.requests for rid in pending):
                        raise RuntimeError(f"requests {sorted(pending)} left the engine without "
                                           "a final output")
                    for o in self.step():
                        q = self._streams.get(o.request_id)
                        if q is not None:
                            q.append(o)
                        else:                 # an add_request's: the next step() returns it
                            self._unclaimed.append(o)
                while queue:
                    o = queue.popleft()
                    yield o
                    if o.finished:
                        pending.discard(o.request_id)
        finally:
            self._close_stream(ids)      # consumer stopped early: do not leak rows

    def stream(self, prompts: PromptLike | Sequence[PromptLike],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[RequestOutput]:
        """Add the prompt(s) and step until they finish, yielding every delta as it is produced.

        Other requests already in the engine keep running (and finishing) in the same steps;
        the outputs of those added with :meth:`add_request` wait for the next :meth:`step`.
        """
        return self._drain(self._add_all(prompts, params, chat))

    def generate(self, prompts: Sequence[PromptLike] | PromptLike, params=None,
                 chat: bool = False) -> list[Completion]:
        """Drain :meth:`stream`; completions in prompt order."""
        t0 = time.perf_counter()
        ids = self._add_all(prompts, params, chat)
        acc = {rid: {"ids": [], "text": [], "first": None, "done": None} for rid in ids}
        for o in self._drain(ids):
            st = acc[o.request_id]
            if st["first"] is None:
                st["first"] = time.perf_counter() - t0
            st["ids"].extend(o.new_token_ids)
            st["text"].append(o.new_text)
            if o.finished:
                st["done"] = (o, time.perf_counter() - t0)
        out = []
        for rid in ids:
            st = acc[rid]
            o, lat = st["done"]
            out.append(Completion(request_id=rid, num_prompt_tokens=o.num_prompt_tokens,
                                  token_ids=st["ids"], text="".join(st["text"]),
                                  finish_reason=o.finish_reason, stats=o.stats, latency_s=lat,
                                  first_token_s=st["first"]))
        return out

    def step_cost_s(self, batch_size: int, tokens_per_row: int = 1) -> float | None:
        """Predicted seconds of one target forward over ``batch_size`` rows x ``tokens_per_row``
        new tokens on this machine (the adaptive controller's measured cost model; a plain step
        is ``tokens_per_row=1``). None when the engine has no cost model (not adaptive, or no
        drafter)."""
        if batch_size < 1 or tokens_per_row < 1:
            raise ValueError("batch_size and tokens_per_row must be >= 1")
        if self.controller is None:
            return None
        return self.controller.cost.verify_s(batch_size, tokens_per_row)

    def stats(self) -> EngineStats:
        return self.metrics

    def reset_stats(self) -> None:
        self.metrics = EngineStats()
