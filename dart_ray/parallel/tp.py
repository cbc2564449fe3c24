"""Tensor parallelism as a transform on a built :class:`~dart_ray.models.llama.Transformer`.

Following gpt-fast, the model code knows nothing of TP: :func:`apply_tensor_parallel` takes a loaded
model and, in place, keeps only rank ``r``'s shard of every attention and MLP block (Megatron
style):

* ``attn.qkv`` becomes *column parallel*: the rows of this rank's q heads and of their k/v heads
  (and the matching bias rows). Heads are assigned by KV group, so grouped-query attention stays
  local: rank ``r`` owns a contiguous range of KV heads and the ``num_heads // num_kv_heads`` query
  heads of each. KV heads are split as evenly as possible, so 3 KV heads over 2 ranks is fine
  (rank 0 gets 2 groups, rank 1 gets 1).
* ``attn.o`` becomes *row parallel* (:class:`RowParallelLinear`): the input columns of the local
  heads, bias on rank 0 only, followed by an all-reduce (sum) so every rank again holds the full
  residual stream.
* ``mlp.gate_up`` keeps this rank's slice of the intermediate dim (its gate rows, then its up rows,
  so ``chunk(2)`` still splits gate from up) and ``mlp.down`` becomes row parallel + all-reduce.
* Embedding, norms (incl. Qwen3's per-head q/k norms), RoPE and the LM head are replicated:
  after each all-reduce the residual stream is identical on all ranks, so logits and DART taps
  are too, and the drafter can live on rank 0 alone.

Each rank's KV cache holds only its local KV heads (:func:`new_tp_cache`).

The sum of the partial products is computed in a different order than the unsharded matmul, so
outputs differ from TP=1 by float rounding (~1e-6 relative in fp32); greedy tokens agree except
at near-ties.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dart_ray.kv_cache import KVCache
from dart_ray.models.args import ModelArgs
from dart_ray.models.llama import Transformer

AllReduce = Callable[[torch.Tensor], None]
"""In-place sum of a tensor over the TP ranks (default: ``torch.distributed.all_reduce``)."""


def split_sizes(n: int, parts: int) -> list[int]:
    """Near-equal contiguous split of ``n`` items into ``parts`` (the first ``n % parts`` get one
    more)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s part of ``n`` items split by :func:`split_sizes`."""
    sizes = split_sizes(n, world)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds of every block."""

    rank: int
    world: int
    kv_heads: tuple[int, int]
    """``[start, stop)`` of this rank's KV heads."""
    q_heads: tuple[int, int]
    """``[start, stop)`` of this rank's query heads (the heads of its KV groups)."""
    intermediate: tuple[int, int]
    """``[start, stop)`` of this rank's slice of the MLP intermediate dim."""

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]


def shard_plan(args: ModelArgs, rank: int, world: int) -> ShardPlan:
    """Rank ``rank``'s shard of a model of shape ``args`` split over ``world`` ranks."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor parallel world size must be an integer >= 1, got {world!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if args.num_kv_heads < world:
        raise ValueError(
            f"cannot split {args.num_kv_heads} KV heads over {world} ranks: tensor_parallel_size "
            f"must be <= num_key_value_heads ({args.num_kv_heads}) for this model")
    if args.intermediate_size < world:
        raise ValueError(f"cannot split intermediate_size {args.intermediate_size} over {world} "
                         "ranks")
    group = args.num_heads // args.num_kv_heads
    k0, k1 = shard_range(args.num_kv_heads, rank, world)
    return ShardPlan(rank=rank, world=world, kv_heads=(k0, k1), q_heads=(k0 * group, k1 * group),
                     intermediate=shard_range(args.intermediate_size, rank, world))


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of (x_local @ W_local^T)`` (+ bias, added once: held by rank 0 only).

    ``x`` holds this rank's slice of the input features; the all-reduce leaves the full output on
    every rank.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # [out, in_local]
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.all_reduce = all_reduce
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.all_reduce is not None:
            self.all_reduce(y)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding exactly these tensors (no allocation of its own)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def _rows(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Copy of the rows ``[a, b)`` of each range, concatenated (a copy, so the full tensor can be
    freed)."""
    return torch.cat([t[a:b] for a, b in ranges]).clone()


def default_all_reduce(group=None) -> AllReduce:
    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    return all_reduce


@torch.no_grad()
def apply_tensor_parallel(model: Transformer, rank: int, world: int, group=None,
                          all_reduce: AllReduce | None = None) -> Transformer:
    """Shard ``model`` in place for rank ``rank`` of ``world``; returns it.

    ``group`` is the torch.distributed process group of the TP ranks (None = the default group);
    ``all_reduce`` overrides the reduction entirely (tests simulate ranks in one process with it).
    ``world == 1`` leaves the model untouched. Build the KV cache with :func:`new_tp_cache`.
    """
    if getattr(model, "tp_world", 1) != 1:
        raise ValueError(f"model is already sharded (rank {model.tp_rank} of {model.tp_world})")
    args = model.args
    plan = shard_plan(args, rank, world)
    model.tp_rank, model.tp_world, model.tp_plan = rank, world, plan
    model.local_kv_heads = plan.num_kv_heads
    if world == 1:
        return model
    reduce = all_reduce if all_reduce is not None else default_all_reduce(group)
    D = args.head_dim
    q_out, kv_out = args.num_heads * D, args.num_kv_heads * D
    (h0, h1), (k0, k1), (i0, i1) = plan.q_heads, plan.kv_heads, plan.intermediate
    inter = args.intermediate_size
    qkv_rows = [(h0 * D, h1 * D), (q_out + k0 * D, q_out + k1 * D),
                (q_out + kv_out + k0 * D, q_out + kv_out + k1 * D)]
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        qkv = attn.qkv                                         # column parallel: local q, k, v rows
        attn.qkv = _linear(_rows(qkv.weight, qkv_rows),
                           _rows(qkv.bias, qkv_rows) if qkv.bias is not None else None)
        o = attn.o                                             # row parallel: local head columns
        o_bias = o.bias.clone() if (o.bias is not None and rank == 0) else None
        attn.o = RowParallelLinear(o.weight[:, h0 * D:h1 * D].clone(), o_bias, reduce)
        attn.n_heads, attn.n_kv = plan.num_heads, plan.num_kv_heads
        attn.split = (plan.num_heads * D, plan.num_kv_heads * D, plan.num_kv_heads * D)
        mlp.gate_up = _linear(_rows(mlp.gate_up.weight, [(i0, i1), (inter + i0, inter + i1)]), None)
        mlp.down = RowParallelLinear(mlp.down.weight[:, i0:i1].clone(), None, reduce)
    return model


def new_tp_cache(model: Transformer, max_batch: int, max_seq_len: int) -> KVCache:
    """A KV cache for ``model`` holding only its local KV heads (works for unsharded models too)."""
    a = model.args
    w = model.embed.weight
    heads = getattr(model, "local_kv_heads", a.num_kv_heads)
    return KVCache(a.num_layers, max_batch, heads, max_seq_len, a.head_dim, w.dtype, w.device)
