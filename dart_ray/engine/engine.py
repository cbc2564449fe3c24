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

import random
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from dart_ray.config import DecodingConfig, EngineConfig, SamplingParams
from dart_ray.drafters.base import BatchView, Drafter
from dart_ray.engine.detok import IncrementalDetokenizer
from dart_ray.engine.metrics import EngineStats
from dart_ray.engine.request import Completion, Request, RequestOutput
from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.models.loading import LoadedTarget
from dart_ray.tree import TokenTree, empty_tree

PromptLike = str | list[int] | list[dict]


class PromptTooLongError(ValueError):
    """The prompt does not fit the context."""


def encode_prompt(tokenizer, prompt: PromptLike, chat: bool = False) -> list[int]:
    """Text (optionally through the chat template), chat messages, or token ids -> ids."""
    if isinstance(prompt, str):
        if chat:
            return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False))
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise TypeError("prompt must be a non-empty string, a list of chat messages, or a list of token ids")


class Engine:
    def __init__(self, target: LoadedTarget, drafter: Drafter, config: EngineConfig) -> None:
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.config = config
        self.drafter = drafter
        self.decoding = config.decoding
        self._schedule = None
        args = target.args
        self.max_seq_len = config.max_seq_len
        if args.sliding_window:
            self.max_seq_len = min(self.max_seq_len, args.sliding_window)
        self.max_batch = config.max_batch_size
        self.cache = self.model.new_cache(self.max_batch, self.max_seq_len)
        self.tokens = np.zeros((self.max_batch, self.max_seq_len), dtype=np.int64)  # committed ids per row
        self.drafter.allocate(self.max_batch, self.max_seq_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.metrics = EngineStats()
        self.eos_ids = frozenset(self._eos_ids())
        self.device = self.model.embed.weight.device
        self.dtype = self.model.embed.weight.dtype
        self._maybe_pack(config.pack_weights)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load target, drafter and N-gram model as the config says (weights load once here)."""
        from dart_ray.drafters import make_drafter
        from dart_ray.models import load_target

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        target = load_target(config.model, config.dtype, config.device, config.max_seq_len)
        drafter = make_drafter(config, target)
        return cls(target, drafter, config)

    def _maybe_pack(self, pack: bool | None) -> None:
        from dart_ray.models.packing import PackedLinear, pack_linears, packing_supported

        supported = packing_supported(self.device, self.dtype) and isinstance(self.model, torch.nn.Module)
        if pack and not supported:
            raise ValueError(f"pack_weights=True needs a local (not TP-proxied) model on CPU in bf16 with "
                             f"oneDNN bf16 support (device {self.device}, dtype {self.dtype})")
        if pack is None:
            pack = supported
        if not pack and isinstance(self.model, torch.nn.Module) and any(
                isinstance(m, PackedLinear) for m in self.model.modules()):
            raise ValueError("pack_weights=False, but this target was already packed in place by another "
                             "engine; load a separate target for an unpacked engine")
        if pack:
            pack_linears(self.model)
            self.drafter.pack_weights()

    def _eos_ids(self) -> set[int]:
        ids = set(self.target.args.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ---- runtime knobs ------------------------------------------------------------------------
    def set_decoding(self, decoding) -> None:
        """Swap runtime knobs: a DecodingConfig, or a schedule with ``for_batch_size(b)``."""
        if isinstance(decoding, DecodingConfig):
            self._schedule = None
            self.decoding = decoding
        elif hasattr(decoding, "for_batch_size"):
            self._schedule = decoding
        else:
            raise TypeError(f"expected DecodingConfig or a schedule, got {type(decoding).__name__}")

    def decoding_for(self, batch_size: int) -> DecodingConfig:
        return self._schedule.for_batch_size(batch_size) if self._schedule is not None else self.decoding

    # ---- requests -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptLike, chat: bool = False) -> list[int]:
        """Text (optionally through the chat template), chat messages, or token ids -> ids."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def check_prompt(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise ValueError("prompt is empty")
        V = self.target.args.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V})")
        limit = self.max_seq_len - self._max_tree_nodes() - 2
        if len(ids) > limit:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context allows at most {limit} "
                f"(max_seq_len {self.max_seq_len} minus tree scratch)")

    def _max_tree_nodes(self) -> int:
        """Tree scratch to reserve: the largest tree any batch size of the active knobs may draft."""
        entries = getattr(self._schedule, "entries", None)
        configs = [c for _, c in entries] if entries else [self.decoding]
        return max(self.drafter.max_tree_nodes(c) for c in configs)

    def add_request(self, prompt: PromptLike, params: SamplingParams | None = None,
                    request_id: str | None = None, chat: bool = False) -> str:
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt, chat)
        self.check_prompt(ids)
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        req = Request(request_id=rid, prompt_ids=ids, params=params,
                      detok=IncrementalDetokenizer(self.tokenizer), generator=gen, stop_ids=frozenset(stop_ids))
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
        return self._output(req, [], "")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.waiting and len(self.running) < self.max_batch:
            self._admit(outputs)
        if self.running:
            self._decode(outputs)
        return outputs

    def _admit(self, outputs: list[RequestOutput]) -> None:
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
        nxt = torch.cat([tokens[:, 1:], torch.zeros(n, 1, dtype=torch.long, device=dev)], dim=1)  # [n, T]
        nxt[torch.arange(n, device=dev), last.view(n)] = acc.bonus
        self.drafter.prefill(rows, lens, out.taps, nxt)
        self.metrics.prefill_s += time.perf_counter() - t0
        now = time.perf_counter()
        finished = []
        for i, r in enumerate(new):
            r.first_token_time = now
            if self._emit(r, [first[i]], outputs):
                finished.append(r)
        if finished:
            self._release(finished)

    def _decode(self, outputs: list[RequestOutput]) -> None:
        m = self.metrics
        B = len(self.running)
        decoding = self.decoding_for(B)
        self._finish_overflowing(decoding, outputs)
        B = len(self.running)
        if B == 0:
            return
        reqs = self.running
        dev = self.device
        t0 = time.perf_counter()
        tree_before = self.drafter.tree_time_s
        roots = torch.tensor([r.root for r in reqs], dtype=torch.long, device=dev)
        view = BatchView(roots=roots, lengths=self.cache.lengths[:B], tokens=self.tokens, decoding=decoding,
                         params=[r.params for r in reqs], generators=[r.generator for r in reqs])
        tree = self.drafter.propose(view)                                        # draft + tree search
        t1 = time.perf_counter()
        tree_dt = self.drafter.tree_time_s - tree_before
        m.draft_s += (t1 - t0) - tree_dt
        m.tree_s += tree_dt

        out = self._verify(tree)                                                 # one target forward
        t2 = time.perf_counter()
        m.verify_s += t2 - t1

        acc = self._accept(tree, out.logits, reqs)                               # path + bonus
        num_committed = (acc.num_accepted + 1).tolist()                          # root + accepted drafts
        path_tokens = self._commit(tree, acc, out.taps, num_committed, view)   # [B][d+1] ids on the path
        t3 = time.perf_counter()
        m.accept_s += t3 - t2

        m.steps += 1                                                             # emit
        bonus = acc.bonus.tolist()
        n_draft = tree.valid.sum(1).sub(1).tolist()
        finished = []
        for b, r in enumerate(reqs):
            k = num_committed[b] - 1
            r.stats.record(n_draft[b], k)
            m.record_row(n_draft[b], k)
            r.root = bonus[b]
            if self._emit(r, path_tokens[b][1:k + 1] + [bonus[b]], outputs):
                finished.append(r)
        if finished:
            self._release(finished)
        m.other_s += time.perf_counter() - t3

    def _verify(self, tree: TokenTree):
        B, T = tree.tokens.shape
        starts = self.cache.lengths[:B]
        positions = torch.tensor(starts, device=self.device)[:, None] + tree.depths   # [B, 1+N]
        if T == 1 and all(s == starts[0] for s in starts):
            mask = None  # one new token per row, equal lengths: it sees every committed slot
        else:
            mask = attention_mask(starts, tree.ancestors(), max(starts) + T, self.dtype)
        return self.model(tree.tokens, positions, mask, self.cache, rows=slice(0, B), starts=starts,
                          taps=self.drafter.taps)

    def _accept(self, tree: TokenTree, logits: torch.Tensor, reqs: list[Request]):
        from dart_ray.verify import accept

        return accept(tree, logits, [r.params for r in reqs], [r.generator for r in reqs])

    def _commit(self, tree: TokenTree, acc, taps, num_committed: list[int], view: BatchView) -> list[list[int]]:
        """Keep the accepted paths' KV, record their tokens, feed the drafter; returns the path tokens."""
        B = tree.batch_size
        dev = tree.tokens.device
        starts = list(self.cache.lengths[:B])
        path = acc.path.clamp(min=0)                                             # [B, d+1] node indices
        self.cache.commit(slice(0, B), path, num_committed)
        path_tokens = torch.gather(tree.tokens, 1, path)                         # [B, d+1]
        toks = path_tokens.tolist()
        for b in range(B):
            n = num_committed[b]
            self.tokens[b, starts[b]:starts[b] + n] = toks[b][:n]
        # what follows each committed position: the next accepted draft, then the new root (bonus)
        A = max(num_committed)
        nxt = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)[:, :A].clone()       # [B, A]
        nxt[torch.arange(B, device=dev), torch.tensor(num_committed, device=dev) - 1] = acc.bonus
        tap_sel = None
        if self.drafter.taps:
            tap_sel = torch.gather(taps, 1, path[:, :A, None].expand(-1, -1, taps.shape[-1]))  # [B, A, nT*H]
        view.lengths = self.cache.lengths[:B]
        self.drafter.observe(view, num_committed, tap_sel, nxt)
        return toks

    # ---- emission / stop conditions ---------------------------------------------------------
    def _emit(self, r: Request, new_ids: list[int], outputs: list[RequestOutput]) -> bool:
        """Append tokens to ``r`` honouring stop conditions; stream a delta. True if finished."""
        p = r.params
        kept: list[int] = []
        reason = None
        for t in new_ids:
            kept.append(t)
            r.output_ids.append(t)
            if t in r.stop_ids:
                reason = "stop"
                break
            if len(r.output_ids) >= p.max_new_tokens:
                reason = "length"
                break
        self.metrics.generated_tokens += len(kept)
        r.detok.push(kept)
        text = r.detok.text
        if p.stop:
            lo = max(0, r.emitted_text_len - max(len(s) for s in p.stop))
            hits = [i for i in (text.find(s, lo) for s in p.stop) if i >= 0]
            if hits:
                cut = min(hits)
                r.detok.text = text = text[:cut]
                reason = "stop"
        if reason:
            r.finished, r.finish_reason = True, reason
            upto = len(text)
        else:
            hold = max((len(s) for s in p.stop), default=1) - 1
            upto = max(r.emitted_text_len, len(text) - hold)
        delta = text[r.emitted_text_len:upto]
        r.emitted_text_len = upto
        outputs.append(self._output(r, kept, delta))
        return r.finished

    def _output(self, r: Request, ids: list[int], text: str) -> RequestOutput:
        return RequestOutput(request_id=r.request_id, new_token_ids=ids, new_text=text, finished=r.finished,
                             finish_reason=r.finish_reason, num_prompt_tokens=len(r.prompt_ids),
                             num_generated_tokens=len(r.output_ids), stats=r.stats)

    def _finish_overflowing(self, decoding: DecodingConfig, outputs: list[RequestOutput]) -> None:
        need = self.drafter.max_tree_nodes(decoding) + 2  # root + tree scratch + the bonus
        over = [r for r in self.running if self.cache.lengths[r.row] + need > self.max_seq_len]
        for r in over:
            r.finished, r.finish_reason = True, "length"
            outputs.append(self._output(r, [], r.detok.text[r.emitted_text_len:]))
        if over:
            self._release(over)

    def _release(self, reqs: Iterable[Request]) -> None:
        """Free the rows of finished requests, compacting the running block to rows 0..B-1."""
        for r in sorted(reqs, key=lambda q: q.row, reverse=True):
            row, last = r.row, len(self.running) - 1
            if row != last:
                moved = self.running[last]
                self.cache.move_row(last, row)
                self.drafter.move_row(last, row)
                self.tokens[row, :self.cache.lengths[row]] = self.tokens[last, :self.cache.lengths[row]]
                self.running[row] = moved
                moved.row = row
            self.running.pop()
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
        if len(params) != len(plist):
            raise ValueError(f"{len(params)} SamplingParams for {len(plist)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(plist, params):
                ids.append(self.add_request(p, sp, chat=chat))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves no orphan requests behind
                self.abort(rid)
            raise
        return ids

    def _drain(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for o in self.step():
                    if o.request_id in pending:
                        yield o
                        if o.finished:
                            pending.discard(o.request_id)
        finally:
            for rid in list(pending):  # consumer stopped early: do not leak rows
                self.abort(rid)

    def stream(self, prompts: PromptLike | Sequence[PromptLike],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[RequestOutput]:
        """Add the prompt(s) and step until they finish, yielding every delta as it is produced.

        Other requests already in the engine keep running (and finishing) in the same steps.
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
            out.append(Completion(request_id=rid, num_prompt_tokens=o.num_prompt_tokens, token_ids=st["ids"],
                                  text="".join(st["text"]), finish_reason=o.finish_reason, stats=o.stats,
                                  latency_s=lat, first_token_s=st["first"]))
        return out

    def stats(self) -> EngineStats:
        return self.metrics

    def reset_stats(self) -> None:
        self.metrics = EngineStats()
