"""Prefix-shared masked training of the DART drafter (target frozen, self-distillation).

For a training sequence x_0..x_{L-1} the frozen target gives, at every position j, the taps
(residual inputs of the tapped layers) and its next-token distribution (top-K kept). The drafter
sees context position j as (E[x_{j+1}], taps_j), exactly as at inference. **Every** prefix j
(context 0..j) gets its own block of d-1 mask slots at positions j+1..j+d-1:

* clean (context) queries: causal over context;
* mask block j: sees context 0..j and, causally, its own slots — never other blocks.

Level t (1..d) of prefix j is the output at context j (t = 1) or mask slot t-1, and is trained
towards the target's distribution at position j+t (which predicts x_{j+t+1}) with forward KL
(cross-entropy against the renormalised teacher top-K), weighted by gamma^(t-1).

The mask-block attention is computed as [scores over the clean prefix keys | scores over the
block's own keys] with one joint softmax, instead of a dense (L*d)^2 mask.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dart_ray.drafters.dart_model import DartConfig, DartModel
from dart_ray.models.packing import pack_linears, packing_supported
from dart_ray.models.rope import apply_rope


ARCHS = ("dart", "eagle", "medusa", "sps")


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of ``dart-ray train-drafter``."""

    data: str
    """Directory of self-distillation shards (``dart-ray gen-data``)."""
    out: str
    """Output directory: checkpoints, final drafter, card, plots."""
    model: str | None = None
    """Target (default: embedded SmolLM2)."""
    arch: str = "dart"
    """What to train: ``dart`` (masked slots), ``eagle`` (the same layer unrolled autoregressively with
    its own features fed back, trained with the unroll), ``medusa`` (K heads on the last hidden
    state) or ``sps`` (a shallow causal draft model distilled from the target)."""
    depth: int = 8
    """Trained draft depth d (levels; EAGLE: unrolled steps; Medusa: heads; SpS: always 1 level)."""
    joint: tuple[str, ...] = ()
    """Further archs trained in the same run on the same batches and teacher pass (``out/<arch>/``);
    each ``"arch"`` or ``"arch:depth"`` (default: ``depth``)."""
    sps_layers: tuple[int, ...] = (0, 1)
    """SpS: target layers the draft model's blocks are initialised from (one block each)."""
    gamma: float = 0.6
    """Level weight base: level t weighted gamma^(t-1)."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 30
    epochs: float = 1.0
    """Passes over the training split (fractional allowed)."""
    max_steps: int | None = None
    """Hard cap on optimizer steps (overrides epochs when smaller)."""
    seqs_per_step: int = 4
    max_len: int = 320
    """Sequences are truncated to this many tokens."""
    teacher_topk: int = 32
    draft_vocab: int = 8192
    """Size of the reduced draft vocabulary (most frequent tokens of the data); 0 = full tied head."""
    grad_clip: float = 0.5
    eval_every: int = 100
    ckpt_every: int = 100
    eval_seqs: int = 48
    seed: int = 0
    threads: int | None = None
    time_budget_s: float | None = None
    """Stop (and save) after this many seconds of training."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.arch != "dart" and not self.draft_vocab:
            raise ValueError(f"arch {self.arch!r} needs a reduced draft vocabulary (draft_vocab > 0)")
        object.__setattr__(self, "sps_layers", tuple(self.sps_layers))
        object.__setattr__(self, "joint", tuple(self.joint))
        for spec in self.joint:
            arch, _, d = spec.partition(":")
            if arch not in ARCHS or (d and not (d.isdigit() and 1 <= int(d) <= 16)):
                raise ValueError(f"joint entries must be 'arch' or 'arch:depth' with arch in {ARCHS}, got {spec!r}")
        if not 1 <= self.depth <= 16:
            raise ValueError("depth must be in [1, 16]")
        if not 0 < self.gamma <= 1:
            raise ValueError("gamma must be in (0, 1]")
        if self.seqs_per_step < 1 or self.max_len < 8:
            raise ValueError("seqs_per_step >= 1 and max_len >= 8 required")


# ---------------------------------------------------------------------------------------------
# teacher
# ---------------------------------------------------------------------------------------------
def teacher_pass(target, cache, batch: torch.Tensor, lens: list[int], taps: tuple[int, ...], topk: int):
    """Target forward over right-padded ``batch`` [B, L] -> taps [B, L, nT*H], top-K ids/logp [B, L, K].

    The target runs in inference mode; the ops here run outside it, so the returned tensors are
    ordinary tensors that autograd may save (the drafter's fc takes the taps as input).
    """
    from dart_ray.masks import attention_mask, causal_ancestors

    B, L = batch.shape
    for r in range(B):
        cache.reset_row(r)
    pos = torch.arange(L).expand(B, L)
    mask = attention_mask([0] * B, causal_ancestors(L), L, target.embed.weight.dtype)
    out = target(batch, pos, mask, cache, rows=slice(0, B), starts=[0] * B, taps=taps)
    logp = torch.log_softmax(out.logits.float(), dim=-1)          # [B, L, V]
    top_lp, top_id = logp.topk(topk, dim=-1)                      # [B, L, K]
    return (out.taps.float() if out.taps is not None else None), top_id, top_lp


# ---------------------------------------------------------------------------------------------
# drafter forward with prefix-shared mask blocks
# ---------------------------------------------------------------------------------------------
def _expand_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def drafter_train_forward(model: DartModel, embed: torch.nn.Embedding, taps: torch.Tensor,
                          tokens: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """taps [B, L, nT*H], tokens [B, L] -> logits [B, L-1, d, Vd] (level t-1 in dim 2) for prefixes 0..L-2.

    ``head_weight``: the target's LM head [V, H], required when the drafter's head is tied.
    """
    cfg = model.cfg
    B, L = tokens.shape
    J = L - 1                       # prefixes (context positions with a known next token)
    M = cfg.depth - 1
    H = cfg.target_hidden
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = model.attn
    with torch.no_grad():
        nxt = embed(tokens[:, 1:]).float()                        # [B, J, H] frozen embedding
    h_ctx, r_ctx = model.context_inputs(taps[:, :J], nxt)         # [B, J, 2H], [B, J, H]
    cos_t, sin_t = model.rope(L + M + 1, h_ctx)
    # --- clean context: causal
    qkv = attn.qkv(model.attn_norm(h_ctx))
    q, k, v = qkv.split(attn.split, dim=-1)
    q = apply_rope(q.view(B, J, nh, hd).transpose(1, 2), cos_t[:J][None, None], sin_t[:J][None, None])  # [B, nh, J, hd]
    k = apply_rope(k.view(B, J, nkv, hd).transpose(1, 2), cos_t[:J][None, None], sin_t[:J][None, None])  # [B, nkv, J, hd]
    v = v.view(B, J, nkv, hd).transpose(1, 2)                                                            # [B, nkv, J, hd]
    rep = nh // nkv
    ke, ve = _expand_kv(k, rep), _expand_kv(v, rep)                                                       # [B, nh, J, hd]
    ctx_out = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)                                   # [B, nh, J, hd]
    # --- mask blocks: block j has slots m=1..M at positions j+m
    m_in, m_res = model.mask_inputs((1,))                                                                # [1, 2H], [1, H]
    mq, mk, mv = attn.qkv(model.attn_norm(m_in)).split(attn.split, dim=-1)                               # [1, *]
    mpos = torch.arange(J)[:, None] + torch.arange(1, M + 1)[None, :]                                     # [J, M]
    cos, sin = cos_t[mpos][None, None], sin_t[mpos][None, None]                                           # [1, 1, J, M, hd]
    mq = apply_rope(mq.view(1, nh, 1, 1, hd), cos, sin)                                                   # [1, nh, J, M, hd]
    mk = apply_rope(mk.view(1, nkv, 1, 1, hd), cos, sin)                                                  # [1, nkv, J, M, hd]
    mk = _expand_kv(mk, rep)                                                                              # [1, nh, J, M, hd]
    mv = _expand_kv(mv.view(1, nkv, 1, 1, hd), rep)                                                       # [1, nh, 1, 1, hd]
    scale = 1.0 / math.sqrt(hd)
    s_ctx = torch.einsum("xhjmd,bhkd->bhjmk", mq, ke) * scale                                             # [B, nh, J, M, J]
    prefix_ok = torch.arange(J)[None, :] <= torch.arange(J)[:, None]                                      # [J(j), J(k)]
    s_ctx = s_ctx.masked_fill(~prefix_ok[None, None, :, None, :], float("-inf"))
    s_blk = torch.einsum("xhjmd,xhjnd->xhjmn", mq, mk) * scale                                            # [1, nh, J, M, M]
    causal = torch.ones(M, M, dtype=torch.bool).tril()
    s_blk = s_blk.masked_fill(~causal, float("-inf")).expand(B, -1, -1, -1, -1)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)                                          # [B, nh, J, M, J+M]
    p_ctx, p_blk = p.split([J, M], dim=-1)
    m_out = torch.einsum("bhjmk,bhkd->bhjmd", p_ctx, ve) + p_blk.sum(-1, keepdim=True) * mv               # [B, nh, J, M, hd]
    # --- rest of the layer on [context | mask slots]
    ctx_o = attn.o(ctx_out.transpose(1, 2).reshape(B, J, nh * hd))                                        # [B, J, H]
    m_o = attn.o(m_out.permute(0, 2, 3, 1, 4).reshape(B, J, M, nh * hd))                                  # [B, J, M, H]
    x = torch.cat([(r_ctx + ctx_o)[:, :, None], m_res.view(1, 1, 1, H) + m_o], dim=2)                     # [B, J, d, H]
    x = x + model.mlp(model.mlp_norm(x))
    if cfg.tie_head and head_weight is None:
        raise ValueError("a tied drafter head needs the target's head_weight")
    return model.logits(model.norm(x), head_weight)                                                       # [B, J, d, Vd]


def eagle_train_forward(model: DartModel, embed: torch.nn.Embedding, taps: torch.Tensor,
                        tokens: torch.Tensor) -> torch.Tensor:
    """EAGLE-style unrolled training ("training-time test"): taps [B, L, nT*H], tokens [B, L]
    -> logits [B, L-1, d, Vd].

    Step 0 is the context pass (context j sees E[x_{j+1}] and fc(taps_j), causal). Step m >= 1 puts,
    for every prefix j, one drafted position j+m whose inputs are E[x_{j+1+m}] (teacher-forced: a
    level only counts when all earlier levels were right) and the *drafter's own* step m-1 output at
    j as its feature -- exactly what inference feeds it. That position attends to context 0..j and
    to the drafted positions of its own chain (steps 1..m), never to other prefixes' chains.
    """
    cfg = model.cfg
    B, L = tokens.shape
    J = L - 1
    K = cfg.depth
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rep = nh // nkv
    attn = model.attn
    with torch.no_grad():
        emb = embed(tokens).float()                                                   # [B, L, H]
    h, resid = model.context_inputs(taps[:, :J], emb[:, 1:])                          # [B, J, 2H], [B, J, H]
    cos_t, sin_t = model.rope(L + K + 1, h)
    scale = 1.0 / math.sqrt(hd)
    prefix_ok = torch.ones(J, J, dtype=torch.bool).tril()                             # key k <= prefix j
    outs: list[torch.Tensor] = []
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    ctx_k = ctx_v = None
    for m in range(K):
        pos = torch.arange(J) + m
        cos, sin = cos_t[pos][None, None], sin_t[pos][None, None]                     # [1, 1, J, hd]
        q, k, v = attn.qkv(model.attn_norm(h)).split(attn.split, dim=-1)
        q = apply_rope(q.view(B, J, nh, hd).transpose(1, 2), cos, sin)                # [B, nh, J, hd]
        k = _expand_kv(apply_rope(k.view(B, J, nkv, hd).transpose(1, 2), cos, sin), rep)  # [B, nh, J, hd]
        v = _expand_kv(v.view(B, J, nkv, hd).transpose(1, 2), rep)                    # [B, nh, J, hd]
        if m == 0:
            ctx_k, ctx_v = k, v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)               # [B, nh, J, hd]
        else:
            own_k.append(k)
            own_v.append(v)
            ok, ov = torch.stack(own_k, dim=3), torch.stack(own_v, dim=3)             # [B, nh, J, m, hd]
            s_ctx = (q @ ctx_k.transpose(-1, -2)) * scale                             # [B, nh, J, J]
            s_ctx = s_ctx.masked_fill(~prefix_ok, float("-inf"))
            s_own = torch.einsum("bhjd,bhjmd->bhjm", q, ok) * scale                   # [B, nh, J, m]
            p = torch.softmax(torch.cat([s_ctx, s_own], dim=-1), dim=-1)
            a = p[..., :J] @ ctx_v + torch.einsum("bhjm,bhjmd->bhjd", p[..., J:], ov)   # [B, nh, J, hd]
        x = resid + attn.o(a.transpose(1, 2).reshape(B, J, nh * hd))
        x = x + model.mlp(model.mlp_norm(x))                                          # [B, J, H]
        outs.append(x)
        if m + 1 < K:
            nxt = (torch.arange(J) + 2 + m).clamp(max=L - 1)                          # token x_{j+2+m}
            h, resid = model.feature_inputs(x, emb[:, nxt])
    return model.logits(model.norm(torch.stack(outs, dim=2)), None)                    # [B, J, K, Vd]


def medusa_train_forward(model, final_hidden: torch.Tensor) -> torch.Tensor:
    """final_hidden [B, L, H] (target tap L) -> logits [B, L-1, K, Vd]."""
    return model(final_hidden[:, :-1])


def sps_train_forward(model, embed: torch.nn.Embedding, tokens: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """tokens [B, L] -> logits [B, L-1, 1, Vd]: the output at position j+1 (next-token prediction
    after x_{j+1}) is "level 1" of prefix j. ``head_weight`` [Vd, H] = the target's head rows d2t."""
    B, L = tokens.shape
    with torch.no_grad():
        x = embed(tokens).float()                                                     # [B, L, H]
    pos = torch.arange(L).expand(B, L)
    mask = torch.zeros(L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    hidden = model.hidden(x, pos, mask[None, None].to(x.dtype), None, L)              # [B, L, H]
    return (hidden[:, 1:] @ head_weight.t().to(hidden.dtype)).unsqueeze(2)           # [B, J, 1, Vd]


def build_model(cfg: "TrainConfig", tgt, d2t: torch.Tensor | None) -> torch.nn.Module:
    """A freshly initialised drafter of ``cfg.arch`` for the loaded target ``tgt``."""
    from dart_ray.drafters.medusa_model import MedusaConfig, MedusaModel
    from dart_ray.drafters.sps_model import SpsConfig, SpsModel

    args, target = tgt.args, tgt.model
    if cfg.arch in ("dart", "eagle"):
        dcfg = DartConfig.for_target(args, tgt.model_id, depth=cfg.depth, arch=cfg.arch,
                                     draft_vocab=cfg.draft_vocab or None, tie_head=not cfg.draft_vocab)
        model = DartModel(dcfg).init_random(cfg.seed)
        if d2t is not None:
            with torch.no_grad():
                model.d2t.copy_(d2t)
                model.head.weight.copy_(target.lm_head.weight[d2t].float())
        return model
    if cfg.arch == "medusa":
        return MedusaModel(MedusaConfig.for_target(args, tgt.model_id, depth=cfg.depth,
                                                   draft_vocab=cfg.draft_vocab)).init_from_target(target, d2t)
    return SpsModel(SpsConfig.for_target(args, tgt.model_id, num_layers=len(cfg.sps_layers),
                                         init_layers=cfg.sps_layers, draft_vocab=cfg.draft_vocab,
                                         max_depth=max(cfg.depth, 1))).init_from_target(target, d2t)


def model_taps(arch: str, model) -> tuple[int, ...]:
    """Target layers the teacher pass must tap for ``arch``."""
    return () if arch == "sps" else tuple(model.cfg.tap_layers)


def train_forward(arch: str, model, target, taps, tokens: torch.Tensor) -> torch.Tensor:
    """Per-prefix level logits [B, L-1, d, Vd] for every architecture (level t of prefix j is trained
    towards the target's distribution at position j+t)."""
    if arch == "dart":
        return drafter_train_forward(model, target.embed, taps, tokens, target.lm_head.weight)
    if arch == "eagle":
        return eagle_train_forward(model, target.embed, taps, tokens)
    if arch == "medusa":
        return medusa_train_forward(model, taps)
    return sps_train_forward(model, target.embed, tokens, target.lm_head.weight[model.d2t])


def level_targets(top_id: torch.Tensor, top_lp: torch.Tensor, t2d: torch.Tensor | None, depth: int,
                  lens: list[int]):
    """Teacher for prefix j, level t = teacher at position j+t -> ids/probs [B, J, d, K] (+ valid mask)."""
    B, L, K = top_id.shape
    J = L - 1
    idx = torch.arange(J)[:, None] + torch.arange(1, depth + 1)[None, :]                # [J, d] source position
    valid = idx[None] < torch.tensor(lens)[:, None, None]                                # [B, J, d]
    idxc = idx.clamp(max=L - 1)
    ids = top_id[:, idxc]                                                                # [B, J, d, K]
    lp = top_lp[:, idxc]                                                                 # [B, J, d, K]
    if t2d is not None:
        ids = t2d[ids]                                                                   # -1 outside the draft vocab
    present = ids >= 0
    p = lp.exp() * present
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    valid = valid & present.any(-1)
    return ids.clamp(min=0), p, valid


def kl_loss(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, valid: torch.Tensor, gamma: float):
    """Forward KL up to the teacher entropy: -sum_k p_k log q(id_k), per level weighted gamma^(t-1)."""
    logq = torch.log_softmax(logits.float(), dim=-1)                    # [B, J, d, Vd]
    ce = -(p * logq.gather(-1, ids)).sum(-1)                            # [B, J, d]
    d = logits.shape[2]
    w = gamma ** torch.arange(d, dtype=torch.float32)                   # [d]
    per_level = (ce * valid).sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)
    return (per_level * w).sum() / w.sum(), per_level.detach()


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def choose_draft_vocab(seqs: list[tuple[list[int], int]], size: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, _ in seqs:
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)
    top = counts.topk(min(size, vocab)).indices
    return top.sort().values


def _batches(seqs, n: int, max_len: int, rng: torch.Generator):
    order = torch.randperm(len(seqs), generator=rng).tolist()
    for i in range(0, len(order) - n + 1, n):
        yield [seqs[k][0][:max_len] for k in order[i:i + n]]


def _batch_stream(seqs, n: int, max_len: int, seed: int, skip: int = 0):
    """Batches epoch after epoch (a fresh seeded permutation each), after the first ``skip``: a run
    resumed at step s sees exactly the batches an uninterrupted run sees from step s on."""
    rng = torch.Generator().manual_seed(seed)
    while True:
        for batch in _batches(seqs, n, max_len, rng):
            if skip > 0:
                skip -= 1
                continue
            yield batch


def _pad(batch: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    lens = [len(s) for s in batch]
    t = torch.zeros(len(batch), max(lens), dtype=torch.long)
    for i, s in enumerate(batch):
        t[i, :len(s)] = torch.tensor(s)
    return t, lens


def level_count(cfg: "TrainConfig") -> int:
    """Levels trained per prefix (SpS drafts one token per forward: one level)."""
    return 1 if cfg.arch == "sps" else cfg.depth


@torch.no_grad()
def evaluate(model, target, cache, embed, seqs, cfg: TrainConfig, t2d) -> dict:
    """Per-level top-1/top-5 accuracy vs the target's argmax and the expected accepted length of a
    greedy chain (1 + mean number of leading correct levels)."""
    model.eval()
    d = level_count(cfg)
    correct = torch.zeros(d)
    top5 = torch.zeros(d)
    total = torch.zeros(d)
    chain = 0.0
    n_prefix = 0
    for i in range(0, len(seqs), cfg.seqs_per_step):
        tokens, lens = _pad([s[0][:cfg.max_len] for s in seqs[i:i + cfg.seqs_per_step]])
        taps, top_id, top_lp = teacher_pass(target, cache, tokens, lens, model_taps(cfg.arch, model), cfg.teacher_topk)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = train_forward(cfg.arch, model, target, taps, tokens)               # [B, J, d, Vd]
        truth = top_id[..., 0]                                                    # [B, L] target argmax
        J = tokens.shape[1] - 1
        idx = (torch.arange(J)[:, None] + torch.arange(1, d + 1)[None, :]).clamp(max=tokens.shape[1] - 1)
        valid = (torch.arange(J)[:, None] + torch.arange(1, d + 1)[None, :])[None] < torch.tensor(lens)[:, None, None]
        tgt = truth[:, idx]                                                       # [B, J, d]
        pred5 = logits.topk(5, dim=-1).indices                                    # [B, J, d, 5]
        if t2d is not None:
            pred5 = model.d2t[pred5]
        ok1 = (pred5[..., 0] == tgt) & valid
        ok5 = (pred5 == tgt[..., None]).any(-1) & valid
        correct += ok1.sum((0, 1)).float()
        top5 += ok5.sum((0, 1)).float()
        total += valid.sum((0, 1)).float()
        full = valid.all(-1)                                                      # prefixes with all d levels in range
        lead = torch.cumprod(ok1.int(), dim=-1).sum(-1)                           # [B, J]
        if cfg.arch == "sps":  # a chain of cfg.depth AR drafts: level-1 hits at j, j+1, ... (teacher-forced)
            D = cfg.depth
            hit = F.pad(ok1[..., 0].int(), (0, D))                                # [B, J+D]
            win = hit.unfold(1, D, 1)[:, :J]                                      # [B, J, D]
            lead = torch.cumprod(win, dim=-1).sum(-1)
            full = (torch.arange(J)[None, :] + D) < torch.tensor(lens)[:, None]
        chain += float(lead[full].sum())
        n_prefix += int(full.sum())
    model.train()
    return {"top1": (correct / total.clamp(min=1)).tolist(), "top5": (top5 / total.clamp(min=1)).tolist(),
            "chain_tau": 1.0 + chain / max(n_prefix, 1), "n_prefixes": n_prefix}


class _Student:
    """One drafter being trained: model, optimiser, schedule, history, output directory."""

    def __init__(self, cfg: TrainConfig, tgt, d2t, out: Path, total: int) -> None:
        self.cfg = cfg
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.model = build_model(cfg, tgt, d2t).train()
        self.taps = model_taps(cfg.arch, self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1))
            * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
        self.step, self.history = 0, {"loss": [], "eval": []}
        self.ckpt = out / "checkpoint"
        self.wall_s = 0.0
        if (self.ckpt / "state.pt").is_file():  # resume
            st = torch.load(self.ckpt / "state.pt", weights_only=False)
            self.model.load_state_dict(st["model"])
            self.opt.load_state_dict(st["opt"])
            self.sched.load_state_dict(st["sched"])
            self.step, self.history = st["step"], st["history"]
            self.wall_s = st.get("wall_s", 0.0)
            print(f"{cfg.arch}: resumed from step {self.step}")

    def update(self, target, taps, tokens, ids, p, valid) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = train_forward(self.cfg.arch, self.model, target, taps, tokens)
        loss, per_level = kl_loss(logits, ids, p, valid, self.cfg.gamma)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.history["loss"].append((self.step, float(loss.detach()), per_level.tolist()))
        self.wall_s += time.perf_counter() - t0
        return float(loss.detach())

    def save_checkpoint(self) -> None:
        self.ckpt.mkdir(exist_ok=True)
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                    "step": self.step, "history": self.history, "wall_s": self.wall_s}, self.ckpt / "state.tmp")
        (self.ckpt / "state.tmp").replace(self.ckpt / "state.pt")


def _select_taps(all_taps: torch.Tensor | None, order: tuple[int, ...], want: tuple[int, ...], H: int):
    """Columns of the teacher's concatenated taps (in ``order``) for the layers ``want``."""
    if not want:
        return None
    return torch.cat([all_taps[..., order.index(t) * H:(order.index(t) + 1) * H] for t in want], dim=-1)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Train ``cfg.arch`` (and every arch in ``cfg.joint``, on the very same batches and teacher pass:
    equal data and steps by construction). Returns the summary of ``cfg.arch``; with ``joint`` the
    students live in ``out/<arch>/``, otherwise in ``out/``."""
    from dart_ray.models import load_target
    from dart_ray.training.gen_data import load_sequences

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = load_target(cfg.model, "bf16", "cpu", max_seq_len=cfg.max_len + 8)
    target, args = tgt.model, tgt.args
    train_seqs = load_sequences(cfg.data, "train")
    val_seqs = load_sequences(cfg.data, "val")[:cfg.eval_seqs] or train_seqs[-cfg.eval_seqs:]
    if not train_seqs:
        raise ValueError(f"no training rows in {cfg.data}")
    embed = target.embed
    cache = target.new_cache(cfg.seqs_per_step, cfg.max_len + 8)
    t2d = d2t = None
    if cfg.draft_vocab:
        d2t = choose_draft_vocab(train_seqs, cfg.draft_vocab, args.vocab_size)
        t2d = torch.full((args.vocab_size,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
        n_tok = sum(len(s) for s, _ in train_seqs)
        covered = sum(int((t2d[torch.tensor(s)] >= 0).sum()) for s, _ in train_seqs)
        print(f"draft vocab {len(d2t)}: covers {covered / n_tok:.1%} of training tokens")
    steps_per_epoch = len(train_seqs) // cfg.seqs_per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_seqs)} training sequences make no batch of seqs_per_step={cfg.seqs_per_step}")
    total = max(1, int(steps_per_epoch * cfg.epochs))
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    cfgs = {cfg.arch: dataclasses.replace(cfg, joint=())}
    for spec in cfg.joint:
        arch, _, d = spec.partition(":")
        cfgs.setdefault(arch, dataclasses.replace(cfg, arch=arch, joint=(), depth=int(d) if d else cfg.depth))
    archs = tuple(cfgs)
    students = [_Student(c, tgt, d2t, out / a if len(archs) > 1 else out, total) for a, c in cfgs.items()]
    step = min(s.step for s in students)
    if len({s.step for s in students}) > 1:
        raise RuntimeError(f"joint students resumed at different steps {[s.step for s in students]}; "
                           "delete the lagging checkpoint or train them separately")
    tap_order = tuple(sorted({t for s in students for t in s.taps}))
    if packing_supported("cpu", target.embed.weight.dtype):
        # the frozen teacher's blocks only run inference (students were built and copied above); the
        # LM head stays dense because the students' objectives read its weight every step
        for layer in target.layers:
            pack_linears(layer)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=step, desc="train-drafter " + ",".join(archs), unit="step")
    t_start = time.perf_counter()
    tokens_seen = 0
    batches = _batch_stream(train_seqs, cfg.seqs_per_step, cfg.max_len, cfg.seed, skip=step)
    while step < total:
        batch = next(batches)
        tokens, lens = _pad(batch)
        t0 = time.perf_counter()
        taps, top_id, top_lp = teacher_pass(target, cache, tokens, lens, tap_order, cfg.teacher_topk)
        teacher_s = (time.perf_counter() - t0) / len(students)  # the shared teacher pass, split evenly
        losses = {}
        for st in students:
            ids, p, valid = level_targets(top_id, top_lp, t2d, level_count(st.cfg), lens)
            losses[st.cfg.arch] = st.update(target, _select_taps(taps, tap_order, st.taps, args.hidden_size),
                                            tokens, ids, p, valid)
            st.wall_s += teacher_s
        step += 1
        tokens_seen += sum(lens)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(**{k: f"{v:.3f}" for k, v in losses.items()},
                            tok_s=f"{tokens_seen / (time.perf_counter() - t_start):.0f}")
        out_of_time = cfg.time_budget_s and time.perf_counter() - t_start > cfg.time_budget_s
        for st in students:
            if step % cfg.eval_every == 0 or step == total:
                ev = evaluate(st.model, target, cache, embed, val_seqs, st.cfg, t2d)
                st.history["eval"].append((step, ev))
                print(f"\n{st.cfg.arch} step {step}: top1 {[round(a, 3) for a in ev['top1']]} "
                      f"chain_tau {ev['chain_tau']:.2f}")
            if step % cfg.ckpt_every == 0 or step >= total or out_of_time:
                st.save_checkpoint()
        if out_of_time:
            break
    if bar is not None:
        bar.close()
    summaries = {}
    for st in students:
        if not st.history["eval"] or st.history["eval"][-1][0] != step:
            st.history["eval"].append((step, evaluate(st.model, target, cache, embed, val_seqs, st.cfg, t2d)))
        final = st.out / "drafter"
        st.model.to(torch.bfloat16).save(final)
        summary = {"arch": st.cfg.arch, "steps": step, "train_seqs": len(train_seqs), "val_seqs": len(val_seqs),
                   "train_wall_s": st.wall_s, "joint_with": [a for a in archs if a != st.cfg.arch],
                   "tokens_seen_this_run": tokens_seen,
                   "final_eval": st.history["eval"][-1][1], "config": asdict(st.cfg),
                   "losses": [h[1] for h in st.history["loss"]],
                   "size_mb": (final / "model.safetensors").stat().st_size / 2**20}
        (st.out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        plot_history(st.history, st.out / "training.png")
        summaries[st.cfg.arch] = summary
    return summaries[cfg.arch]


def plot_history(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if history["loss"]:
        s = [h[0] for h in history["loss"]]
        a1.plot(s, [h[1] for h in history["loss"]], lw=0.8)
        a1.set_xlabel("step")
        a1.set_ylabel("weighted KL loss")
        a1.set_title("training loss")
    if history["eval"]:
        s = [e[0] for e in history["eval"]]
        d = len(history["eval"][0][1]["top1"])
        for t in range(d):
            a2.plot(s, [e[1]["top1"][t] for e in history["eval"]], marker="o", label=f"level {t + 1}")
        a2.set_xlabel("step")
        a2.set_ylabel("top-1 accuracy (held-out)")
        a2.legend(fontsize=7)
        a2.set_title("per-level accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
