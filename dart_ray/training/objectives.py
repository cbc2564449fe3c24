"""Training objectives: how each drafter architecture is built, fed and scored while it trains.

Every architecture trains the same way (:mod:`dart_ray.training.trainer` runs the loop). For a
training sequence x_0..x_{L-1} the frozen target's teacher pass (:func:`teacher_pass`) gives, at
every position j, the taps (residual inputs of the tapped layers) and its next-token distribution
(top-K kept). The student turns the batch into **level logits** [B, L-1, d, Vd]: level t (1..d) of
prefix j (context x_0..x_j) is trained towards the target's distribution at position j+t (which
predicts x_{j+t+1}) with forward KL -- cross-entropy against the teacher top-K renormalised over the
draft vocabulary -- weighted gamma^(t-1) (:func:`level_targets`, :func:`kl_loss`).

What differs per architecture is one :class:`Objective`, found by the method registry's
``MethodSpec.objective`` name (:func:`get_objective`; ``train-drafter --arch``):

=========  ==================  ==========================================================  ======
objective  network             level logits                                                levels
=========  ==================  ==========================================================  ======
``dart``   DartModel           one forward; every prefix gets its own block of d-1 mask    d
                               slots (:func:`drafter_train_forward`)
``eagle``  DartModel (eagle)   d unrolled steps, its own features fed back as inference    d
                               feeds them (:func:`eagle_train_forward`)
``medusa`` MedusaModel         K heads on the target's last hidden state                   K
                               (:func:`medusa_train_forward`)
``sps``    SpsModel            a shallow causal draft model's next-token logits            1
                               (:func:`sps_train_forward`)
=========  ==================  ==========================================================  ======

DART's prefix-shared masks: the drafter sees context position j as (E[x_{j+1}], taps_j), exactly as
at inference; clean (context) queries are causal over the context; mask block j (slots at positions
j+1..j+d-1) sees context 0..j and, causally, its own slots -- never other blocks. Its attention is
computed as [scores over the clean prefix keys | scores over the block's own keys] with one joint
softmax instead of a dense (L*d)^2 mask. ``tests/training/test_training.py`` checks every training
forward against its inference drafter on every prefix, so train/serve skew is ruled out by test.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from dart_ray.drafters.dart_model import DartConfig, DartModel
from dart_ray.masks import causal_ancestors
from dart_ray.methods import method_specs
from dart_ray.models.rope import apply_rope

if TYPE_CHECKING:
    from dart_ray.training.trainer import TrainConfig

__all__ = [
    "LevelTargets",
    "Objective",
    "drafter_train_forward",
    "eagle_train_forward",
    "get_objective",
    "init_from_target_layer",
    "kl_loss",
    "level_positions",
    "level_targets",
    "medusa_train_forward",
    "objective_names",
    "pad_batch",
    "register_objective",
    "select_taps",
    "sps_train_forward",
    "student_autocast",
    "teacher_pass",
]


# ---------------------------------------------------------------------------------------------
# the interface and one objective per architecture
# ---------------------------------------------------------------------------------------------
class LevelTargets(NamedTuple):
    """The teacher for every (prefix j, level t): position j+t's top-K, in draft-vocabulary ids."""

    ids: torch.Tensor    # [B, J, d, K] draft-vocabulary ids (0 where outside it; p is 0 there)
    p: torch.Tensor      # [B, J, d, K] teacher probabilities renormalised over the draft vocab
    valid: torch.Tensor  # [B, J, d] j+t inside the sequence (and some teacher mass expressible)
    weight: torch.Tensor | None = None  # [B, J] per-prefix loss weight (None: all 1)


class Objective:
    """One architecture's training: its network, the taps it reads, its level logits, its loss.

    Subclasses set :attr:`name` (a ``MethodSpec.objective``) and implement :meth:`build` and
    :meth:`forward`; the rest has defaults for a drafter predicting ``cfg.depth`` levels per prefix.
    """

    name: str = ""
    needs_draft_vocab: bool = True
    """Trains only with a reduced draft vocabulary (``draft_vocab > 0``)."""
    inits_from_target_layer: bool = False
    """Accepts ``init_from_target`` (its layer can start as a copy of a target layer)."""
    revocabs: bool = False
    """Accepts ``revocab`` (one own head ``head.weight`` over the draft vocabulary ``d2t``)."""
    sizes_mlp: bool = False
    """Accepts ``mlp_width`` (one llama MLP ``mlp.gate_up`` / ``mlp.down``; a resumed one can grow,
    :func:`grow_mlp`)."""

    def build(self, cfg: TrainConfig, tgt, d2t: torch.Tensor | None, new: bool) -> torch.nn.Module:
        """The network of ``cfg`` for the loaded target ``tgt`` (float32). ``new``: its weights are
        the ones it trains from (no checkpoint or drafter is loaded into it afterwards)."""
        raise NotImplementedError

    def taps(self, model) -> tuple[int, ...]:
        """Target layers the teacher pass taps for ``model``."""
        return tuple(model.cfg.tap_layers)

    def levels(self, cfg: TrainConfig) -> int:
        """Levels trained (and evaluated) per prefix."""
        return cfg.depth

    def chain_levels(self, cfg: TrainConfig) -> int | None:
        """Length of the evaluated draft chain when it is not :meth:`levels`
        (``LevelCounts.chain_levels``)."""
        return None

    def forward(self, model, target, taps: torch.Tensor | None,
                tokens: torch.Tensor) -> torch.Tensor:
        """Level logits [B, L-1, d, Vd] of every prefix of ``tokens`` [B, L] (``taps``
        [B, L, nT*H])."""
        raise NotImplementedError

    def targets(self, top_id: torch.Tensor, top_lp: torch.Tensor, t2d: torch.Tensor | None,
                cfg: TrainConfig, lens: list[int],
                prompt_lens: list[int] | None = None) -> LevelTargets:
        """The teacher pass's top-K [B, L, K] as per-level targets (:func:`level_targets`), the
        prompt's prefixes weighted ``cfg.prompt_weight`` (:func:`prefix_weights`)."""
        J = top_id.shape[1] - 1
        return LevelTargets(*level_targets(top_id, top_lp, t2d, self.levels(cfg), lens),
                            weight=prefix_weights(prompt_lens, J, cfg.prompt_weight,
                                                  top_id.device))

    def loss(self, logits: torch.Tensor, targets: LevelTargets,
             gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss, per-level loss [d]): :func:`kl_loss`."""
        return kl_loss(logits, targets.ids, targets.p, targets.valid, gamma, targets.weight)

    def leading_correct(self, ok1: torch.Tensor, valid: torch.Tensor, lens: list[int],
                        cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """From per-level top-1 hits ``ok1`` [B, J, d]: the leading correct levels of each prefix
        [B, J] and the prefixes whose whole chain lies inside the sequence [B, J]
        (``chain_tau``)."""
        return torch.cumprod(ok1.int(), dim=-1).sum(-1), valid.all(-1)


class DartObjective(Objective):
    """DART: prefix-shared mask blocks, all d levels from one forward."""

    name = "dart"
    needs_draft_vocab = False
    inits_from_target_layer = True
    revocabs = True
    sizes_mlp = True

    def build(self, cfg, tgt, d2t, new):
        args, target = tgt.args, tgt.model
        dcfg = DartConfig.for_target(args, tgt.model_id, depth=cfg.depth, arch=self.name,
                                     draft_vocab=cfg.draft_vocab or None,
                                     tie_head=not cfg.draft_vocab,
                                     intermediate_size=cfg.mlp_width or args.intermediate_size)
        model = DartModel(dcfg).init_random(cfg.seed)
        if d2t is not None:
            with torch.no_grad():
                model.d2t.copy_(d2t)
                model.head.weight.copy_(target.lm_head.weight[d2t].float())
        if cfg.init_from_target and new:
            init_from_target_layer(model, target, cfg.init_layer if cfg.init_layer is not None
                                   else dcfg.tap_layers[-1])
        return model

    def forward(self, model, target, taps, tokens):
        return drafter_train_forward(model, target.embed, taps, tokens, target.lm_head.weight)


class EagleObjective(DartObjective):
    """EAGLE-style: the DART layer unrolled d steps on its own features (training-time test)."""

    name = "eagle"
    needs_draft_vocab = True

    def forward(self, model, target, taps, tokens):
        return eagle_train_forward(model, target.embed, taps, tokens)


class MedusaObjective(Objective):
    """Medusa: K heads on the target's last hidden state (level k = head k), heads start from the
    target's."""

    name = "medusa"

    def build(self, cfg, tgt, d2t, new):
        from dart_ray.drafters.medusa_model import MedusaConfig, MedusaModel

        mcfg = MedusaConfig.for_target(tgt.args, tgt.model_id, depth=cfg.depth,
                                       draft_vocab=cfg.draft_vocab)
        return MedusaModel(mcfg).init_from_target(tgt.model, d2t)

    def forward(self, model, target, taps, tokens):
        return medusa_train_forward(model, taps)


class SpsObjective(Objective):
    """SpS: a shallow causal draft model (blocks copied from target layers ``cfg.sps_layers``)
    distilled on next-token prediction; it drafts a chain of ``cfg.depth`` one-token steps."""

    name = "sps"

    def build(self, cfg, tgt, d2t, new):
        from dart_ray.drafters.sps_model import SpsConfig, SpsModel

        scfg = SpsConfig.for_target(tgt.args, tgt.model_id, num_layers=len(cfg.sps_layers),
                                    init_layers=cfg.sps_layers, draft_vocab=cfg.draft_vocab,
                                    max_depth=max(cfg.depth, 1))
        return SpsModel(scfg).init_from_target(tgt.model, d2t)

    def taps(self, model):
        return ()

    def levels(self, cfg):
        return 1

    def chain_levels(self, cfg):
        return cfg.depth

    def forward(self, model, target, taps, tokens):
        return sps_train_forward(model, target.embed, tokens, target.lm_head.weight[model.d2t])

    def leading_correct(self, ok1, valid, lens, cfg):
        """A chain of ``cfg.depth`` autoregressive drafts: level-1 hits at j, j+1, ...
        (teacher-forced)."""
        D, J = cfg.depth, ok1.shape[1]
        hit = F.pad(ok1[..., 0].int(), (0, D))                                    # [B, J+D]
        win = hit.unfold(1, D, 1)[:, :J]                                          # [B, J, D]
        dev = ok1.device
        full = ((torch.arange(J, device=dev)[None, :] + D)
                < torch.tensor(lens, device=dev)[:, None])                        # [B, J]
        return torch.cumprod(win, dim=-1).sum(-1), full


_OBJECTIVES: dict[str, Objective] = {}


def register_objective(objective: Objective) -> Objective:
    """Make ``objective`` the implementation of ``MethodSpec.objective == objective.name``."""
    if not objective.name:
        raise ValueError("an objective needs a name (the MethodSpec.objective it implements)")
    _OBJECTIVES[objective.name] = objective
    return objective


register_objective(DartObjective())
register_objective(EagleObjective())
register_objective(MedusaObjective())
register_objective(SpsObjective())


def objective_names() -> tuple[str, ...]:
    """The registered methods' training objectives (``--arch`` choices), in registration order."""
    return tuple(s.objective for s in method_specs() if s.objective)


def get_objective(name: str) -> Objective:
    """The :class:`Objective` of the registered method whose ``objective`` is ``name``."""
    names = objective_names()
    if name not in names:
        raise ValueError(f"arch must be one of {names}, got {name!r}")
    if name not in _OBJECTIVES:
        raise ValueError(f"the method registry names the training objective {name!r} but no "
                         "Objective implements it (dart_ray/training/objectives.py: "
                         "register_objective)")
    return _OBJECTIVES[name]


def student_autocast(dtype: str, device: str | torch.device = "cpu") -> AbstractContextManager:
    """The student's forward runs under bf16 autocast when the run's resolved dtype is ``bf16``
    (its weights and optimizer stay float32); in ``fp32`` it runs as is. ``device``: where it runs
    (autocast is per device type)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                          enabled=dtype == "bf16")


# ---------------------------------------------------------------------------------------------
# teacher
# ---------------------------------------------------------------------------------------------
def pad_batch(batch: list[list[int]],
              device: str | torch.device | None = None) -> tuple[torch.Tensor, list[int]]:
    """Sequences -> right-padded ids [B, max len] (on ``device``; default CPU) and their lengths
    (what :func:`teacher_pass` takes)."""
    lens = [len(s) for s in batch]
    t = torch.zeros(len(batch), max(lens), dtype=torch.long)
    for i, s in enumerate(batch):
        t[i, :len(s)] = torch.tensor(s)
    return (t if device is None else t.to(device)), lens


def teacher_pass(target, cache, batch: torch.Tensor, lens: list[int], taps: tuple[int, ...],
                 topk: int):
    """Target forward over right-padded ``batch`` [B, L] -> taps [B, L, nT*H], top-K ids/logp
    [B, L, K].

    The target runs in inference mode; the ops here run outside it, so the returned tensors are
    ordinary tensors that autograd may save (the drafter's fc takes the taps as input).
    """
    from dart_ray.masks import attention_mask, causal_ancestors

    B, L = batch.shape
    for r in range(B):
        cache.reset_row(r)
    pos = torch.arange(L, device=batch.device).expand(B, L)
    mask = attention_mask([0] * B, causal_ancestors(L, batch.device), L, target.embed.weight.dtype)
    out = target(batch, pos, mask, cache, rows=slice(0, B), starts=[0] * B, taps=taps)
    top_id, top_lp = top_logprobs(out.logits, topk)               # [B, L, K] each
    return (out.taps.float() if out.taps is not None else None), top_id, top_lp


TOP_LOGPROBS_CHUNK = 32
"""Positions per chunk of :func:`top_logprobs`: 32 x 49k float32 = 6 MB, cache-sized."""


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits.float()).topk(k)`` of [..., V] logits -> ids [..., k], log-probs
    [..., k] float32, a chunk of positions at a time: the same numbers without materialising
    two float32 copies of a whole batch's logits (8 x 320 x 49k: 500 MB each)."""
    *lead, V = logits.shape
    flat = logits.reshape(-1, V)                                   # [N, V]
    ids = torch.empty(flat.shape[0], k, dtype=torch.long, device=logits.device)
    lps = torch.empty(flat.shape[0], k, dtype=torch.float32, device=logits.device)
    for s in range(0, flat.shape[0], TOP_LOGPROBS_CHUNK):
        x = flat[s:s + TOP_LOGPROBS_CHUNK].float()                 # [c, V]
        v, i = x.topk(k, dim=-1)                                   # [c, k]
        lps[s:s + TOP_LOGPROBS_CHUNK] = v - torch.logsumexp(x, dim=-1, keepdim=True)
        ids[s:s + TOP_LOGPROBS_CHUNK] = i
    return ids.view(*lead, k), lps.view(*lead, k)


def select_taps(taps: torch.Tensor | None, order: tuple[int, ...],
                want: tuple[int, ...]) -> torch.Tensor | None:
    """A student's taps [B, L, len(want)*H] from a teacher pass over the layers ``order`` (its
    ``taps`` [B, L, len(order)*H]): the columns of the layers ``want``, in that order; None for
    none; the tensor itself when ``want`` is ``order``."""
    if not want:
        return None
    if tuple(want) == tuple(order):
        return taps
    H = taps.shape[-1] // len(order)
    return torch.cat([taps[..., order.index(t) * H:(order.index(t) + 1) * H] for t in want],
                     dim=-1)


# ---------------------------------------------------------------------------------------------
# training forwards: level logits [B, L-1, d, Vd]
# ---------------------------------------------------------------------------------------------
def _expand_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def drafter_train_forward(model: DartModel, embed: torch.nn.Embedding, taps: torch.Tensor,
                          tokens: torch.Tensor,
                          head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """taps [B, L, nT*H], tokens [B, L] -> logits [B, L-1, d, Vd] (level t-1 in dim 2) for prefixes
    0..L-2.

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
    q = apply_rope(q.view(B, J, nh, hd).transpose(1, 2), cos_t[:J][None, None],  # [B, nh, J, hd]
                   sin_t[:J][None, None])
    k = apply_rope(k.view(B, J, nkv, hd).transpose(1, 2), cos_t[:J][None, None],  # [B, nkv, J, hd]
                   sin_t[:J][None, None])
    v = v.view(B, J, nkv, hd).transpose(1, 2)                                   # [B, nkv, J, hd]
    rep = nh // nkv
    ke, ve = _expand_kv(k, rep), _expand_kv(v, rep)                             # [B, nh, J, hd]
    ctx_out = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)         # [B, nh, J, hd]
    # --- mask blocks: block j has slots m=1..M at positions j+m
    m_in, m_res = model.mask_inputs((1,))                                       # [1, 2H], [1, H]
    mq, mk, mv = attn.qkv(model.attn_norm(m_in)).split(attn.split, dim=-1)      # [1, *]
    dev = tokens.device
    mpos = (torch.arange(J, device=dev)[:, None]
            + torch.arange(1, M + 1, device=dev)[None, :])                      # [J, M]
    cos, sin = cos_t[mpos][None, None], sin_t[mpos][None, None]                 # [1, 1, J, M, hd]
    mq = apply_rope(mq.view(1, nh, 1, 1, hd), cos, sin)                         # [1, nh, J, M, hd]
    mk = apply_rope(mk.view(1, nkv, 1, 1, hd), cos, sin)                        # [1, nkv, J, M, hd]
    mk = _expand_kv(mk, rep)                                                    # [1, nh, J, M, hd]
    mv = _expand_kv(mv.view(1, nkv, 1, 1, hd), rep)                             # [1, nh, 1, 1, hd]
    scale = 1.0 / math.sqrt(hd)
    s_ctx = torch.einsum("xhjmd,bhkd->bhjmk", mq, ke) * scale                   # [B, nh, J, M, J]
    prefix_ok = (torch.arange(J, device=dev)[None, :]
                 <= torch.arange(J, device=dev)[:, None])                       # [J(j), J(k)]
    s_ctx = s_ctx.masked_fill(~prefix_ok[None, None, :, None, :], float("-inf"))
    s_blk = torch.einsum("xhjmd,xhjnd->xhjmn", mq, mk) * scale                  # [1, nh, J, M, M]
    causal = causal_ancestors(M, dev)
    s_blk = s_blk.masked_fill(~causal, float("-inf")).expand(B, -1, -1, -1, -1)
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)                # [B, nh, J, M, J+M]
    p_ctx, p_blk = p.split([J, M], dim=-1)
    m_out = (torch.einsum("bhjmk,bhkd->bhjmd", p_ctx, ve)                       # [B, nh, J, M, hd]
             + p_blk.sum(-1, keepdim=True) * mv)
    # --- rest of the layer on [context | mask slots]
    ctx_o = attn.o(ctx_out.transpose(1, 2).reshape(B, J, nh * hd))              # [B, J, H]
    m_o = attn.o(m_out.permute(0, 2, 3, 1, 4).reshape(B, J, M, nh * hd))        # [B, J, M, H]
    m_x = m_res.view(1, 1, 1, H) + m_o                                          # [B, J, M, H]
    x = torch.cat([(r_ctx + ctx_o)[:, :, None], m_x], dim=2)                    # [B, J, d, H]
    x = x + model.mlp(model.mlp_norm(x))
    if cfg.tie_head and head_weight is None:
        raise ValueError("a tied drafter head needs the target's head_weight")
    return model.logits(model.norm(x), head_weight)                             # [B, J, d, Vd]


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
        emb = embed(tokens).float()                                          # [B, L, H]
    h, resid = model.context_inputs(taps[:, :J], emb[:, 1:])                 # [B, J, 2H], [B, J, H]
    cos_t, sin_t = model.rope(L + K + 1, h)
    scale = 1.0 / math.sqrt(hd)
    dev = tokens.device
    prefix_ok = causal_ancestors(J, dev)                                     # key k <= prefix j
    outs: list[torch.Tensor] = []
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    ctx_k = ctx_v = None
    for m in range(K):
        pos = torch.arange(J, device=dev) + m
        cos, sin = cos_t[pos][None, None], sin_t[pos][None, None]            # [1, 1, J, hd]
        q, k, v = attn.qkv(model.attn_norm(h)).split(attn.split, dim=-1)
        q = apply_rope(q.view(B, J, nh, hd).transpose(1, 2), cos, sin)       # [B, nh, J, hd]
        k = apply_rope(k.view(B, J, nkv, hd).transpose(1, 2), cos, sin)
        k = _expand_kv(k, rep)                                               # [B, nh, J, hd]
        v = _expand_kv(v.view(B, J, nkv, hd).transpose(1, 2), rep)           # [B, nh, J, hd]
        if m == 0:
            ctx_k, ctx_v = k, v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # [B, nh, J, hd]
        else:
            own_k.append(k)
            own_v.append(v)
            ok, ov = torch.stack(own_k, dim=3), torch.stack(own_v, dim=3)    # [B, nh, J, m, hd]
            s_ctx = (q @ ctx_k.transpose(-1, -2)) * scale                    # [B, nh, J, J]
            s_ctx = s_ctx.masked_fill(~prefix_ok, float("-inf"))
            s_own = torch.einsum("bhjd,bhjmd->bhjm", q, ok) * scale          # [B, nh, J, m]
            p = torch.softmax(torch.cat([s_ctx, s_own], dim=-1), dim=-1)
            a = (p[..., :J] @ ctx_v                                          # [B, nh, J, hd]
                 + torch.einsum("bhjm,bhjmd->bhjd", p[..., J:], ov))
        x = resid + attn.o(a.transpose(1, 2).reshape(B, J, nh * hd))
        x = x + model.mlp(model.mlp_norm(x))                                 # [B, J, H]
        outs.append(x)
        if m + 1 < K:
            nxt = (torch.arange(J, device=dev) + 2 + m).clamp(max=L - 1)     # token x_{j+2+m}
            h, resid = model.feature_inputs(x, emb[:, nxt])
    return model.logits(model.norm(torch.stack(outs, dim=2)), None)          # [B, J, K, Vd]


def medusa_train_forward(model, final_hidden: torch.Tensor) -> torch.Tensor:
    """final_hidden [B, L, H] (target tap L) -> logits [B, L-1, K, Vd]."""
    return model(final_hidden[:, :-1])


def sps_train_forward(model, embed: torch.nn.Embedding, tokens: torch.Tensor,
                      head_weight: torch.Tensor) -> torch.Tensor:
    """tokens [B, L] -> logits [B, L-1, 1, Vd]: the output at position j+1 (next-token prediction
    after x_{j+1}) is "level 1" of prefix j. ``head_weight`` [Vd, H] = the target's head rows
    d2t."""
    B, L = tokens.shape
    with torch.no_grad():
        x = embed(tokens).float()                                                     # [B, L, H]
    dev = tokens.device
    pos = torch.arange(L, device=dev).expand(B, L)
    mask = torch.zeros(L, L, device=dev).masked_fill(
        ~torch.ones(L, L, dtype=torch.bool, device=dev).tril(), float("-inf"))
    hidden = model.hidden(x, pos, mask[None, None].to(x.dtype), None, L)              # [B, L, H]
    return (hidden[:, 1:] @ head_weight.t().to(hidden.dtype)).unsqueeze(2)           # [B, J, 1, Vd]



# ---------------------------------------------------------------------------------------------
# targets and loss (every objective)
# ---------------------------------------------------------------------------------------------
def level_positions(J: int, depth: int, lens: list[int],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Position j+t of prefix j's level t (t = 1..depth) [J, d], and whether it lies inside each
    sequence of lengths ``lens`` [B, J, d] (what training targets and evaluation both score)."""
    idx = (torch.arange(J, device=device)[:, None]
           + torch.arange(1, depth + 1, device=device)[None, :])            # [J, d]
    return idx, idx[None] < torch.tensor(lens, device=device)[:, None, None]


def answer_prefixes(prompt_lens: list[int], J: int, device) -> torch.Tensor:
    """[B, J] bool: prefix j ends inside the answer (j >= prompt length - 1), so the drafter's root
    x_{j+1} and every level after it are generated tokens -- the prefixes drafting meets."""
    start = torch.tensor([max(p - 1, 0) for p in prompt_lens], device=device)
    return torch.arange(J, device=device)[None, :] >= start[:, None]


def prefix_weights(prompt_lens: list[int] | None, J: int, prompt_weight: float,
                   device) -> torch.Tensor | None:
    """[B, J] loss weight per prefix: 1 in the answer, ``prompt_weight`` in the prompt; None when
    every prefix weighs 1 (``prompt_weight`` 1, or no prompt lengths given)."""
    if prompt_lens is None or prompt_weight == 1:
        return None
    ans = answer_prefixes(prompt_lens, J, device)
    return torch.where(ans, 1.0, float(prompt_weight))


def level_targets(top_id: torch.Tensor, top_lp: torch.Tensor, t2d: torch.Tensor | None, depth: int,
                  lens: list[int]):
    """Teacher for prefix j, level t = teacher at position j+t -> ids/probs [B, J, d, K] (+ valid
    mask)."""
    B, L, K = top_id.shape
    J = L - 1
    idx, valid = level_positions(J, depth, lens, top_id.device)         # [J, d], [B, J, d]
    idxc = idx.clamp(max=L - 1)
    ids = top_id[:, idxc]                                               # [B, J, d, K]
    lp = top_lp[:, idxc]                                                # [B, J, d, K]
    if t2d is not None:
        ids = t2d[ids]                                                  # -1 outside the draft vocab
    present = ids >= 0
    p = lp.exp() * present
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    valid = valid & present.any(-1)
    return ids.clamp(min=0), p, valid


def kl_loss(logits: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, valid: torch.Tensor,
            gamma: float, weight: torch.Tensor | None = None):
    """Forward KL up to the teacher entropy: -sum_k p_k log q(id_k), per level weighted
    gamma^(t-1); each level's loss is the mean over valid prefixes, each prefix weighted
    ``weight`` [B, J] when given (per level: a level whose only valid prefixes in the batch are
    down-weighted ones still gets a full-weight mean of them)."""
    logq = torch.log_softmax(logits.float(), dim=-1)                    # [B, J, d, Vd]
    ce = -(p * logq.gather(-1, ids)).sum(-1)                            # [B, J, d]
    d = logits.shape[2]
    w = gamma ** torch.arange(d, dtype=torch.float32, device=logits.device)  # [d]
    m = valid.float() if weight is None else valid * weight[..., None]  # [B, J, d]
    per_level = (ce * m).sum((0, 1)) / m.sum((0, 1)).clamp(min=1e-6)
    return (per_level * w).sum() / w.sum(), per_level.detach()



@torch.no_grad()
def grow_mlp(state: dict[str, torch.Tensor], width: int, seed: int) -> dict[str, torch.Tensor]:
    """A dart/eagle drafter's weights with its MLP widened to ``width`` units, its function kept.

    ``mlp.gate_up.weight`` [2I, H] is [gate; up]: each half gets ``width - I`` new rows
    (N(0, 0.02), as a new drafter's); ``mlp.down.weight`` [H, I] gets zero columns for them, so the
    layer's output is unchanged until training moves them (the down columns get gradients at once:
    the new units' activations are non-zero). Every other tensor is passed through.
    """
    gate_up, down = state["mlp.gate_up.weight"], state["mlp.down.weight"]
    hidden, units = down.shape
    if width < units:
        raise ValueError(f"mlp_width {width} is narrower than the resumed drafter's MLP ({units})")
    g = torch.Generator().manual_seed(seed)
    new = (torch.randn(2, width - units, hidden, generator=g) * 0.02).to(gate_up.dtype)
    gate, up = gate_up.chunk(2, dim=0)
    out = dict(state)
    out["mlp.gate_up.weight"] = torch.cat([gate, new[0], up, new[1]], dim=0)
    out["mlp.down.weight"] = torch.cat([down, down.new_zeros(hidden, width - units)], dim=1)
    return out


# ---------------------------------------------------------------------------------------------
# init_from_target (dart, eagle)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def init_from_target_layer(model: DartModel, target, layer: int) -> DartModel:
    """Start a DART/EAGLE drafter's layer from target layer ``layer`` (see
    ``TrainConfig.init_from_target``).

    The drafter's attention input is [RMSNorm(E[x_{j+1}]) | RMSNorm(fc(taps_j))] (2H). ``fc`` starts
    as the identity on the tap of ``layer`` when that layer is tapped (else on the last tap), so the
    tap half carries the residual the target layer itself reads; the attention weights of that half,
    ``o``, the MLP and the norms are the target layer's (the attention norm's tap half = the
    target's input norm); the embedding half keeps its small random init; the final norm is the
    target's. Attention biases and q/k norms of Qwen-style targets are not carried (the drafter has
    none).
    """
    cfg = model.cfg
    H = cfg.target_hidden
    src = target.layers[layer]
    taps = list(cfg.tap_layers)
    k = taps.index(layer) if layer in taps else len(taps) - 1
    model.fc.weight.zero_()
    model.fc.weight[:, k * H:(k + 1) * H].copy_(torch.eye(H, device=model.fc.weight.device))
    model.attn.qkv.weight[:, H:].copy_(src.attn.qkv.weight.float())
    model.attn_norm.weight[H:].copy_(src.attn_norm.weight.float())
    model.attn.o.weight.copy_(src.attn.o.weight.float())
    model.mlp_norm.weight.copy_(src.mlp_norm.weight.float())
    model.mlp.gate_up.weight.copy_(src.mlp.gate_up.weight.float())
    model.mlp.down.weight.copy_(src.mlp.down.weight.float())
    model.norm.weight.copy_(target.norm.weight.float())
    return model
