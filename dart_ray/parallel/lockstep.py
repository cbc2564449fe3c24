"""Running one :class:`~dart_ray.engine.Engine` over tensor-parallel ranks in lockstep.

Rank 0 runs the engine (scheduler, drafter, tree search, acceptance); ranks 1..N-1 are *followers*
that hold the other shards and execute exactly the model and KV-cache calls rank 0 makes, in the
same order. Rank 0's engine sees two stand-ins with the interfaces it already uses:

* :class:`TPModelProxy` looks like the Transformer (call/forward, ``new_cache``, ``embed``,
  ``lm_head``, ``head``, ``args``);
* :class:`TPCacheProxy` looks like the :class:`~dart_ray.kv_cache.KVCache` (``lengths``,
  ``commit``, ``commit_all``, ``reset_row``, ``move_row``, ...).

Each mutating call is first broadcast as a *command* (op name + small Python arguments on a gloo
control group, then its tensors on the TP group) and then executed locally; the followers'
:func:`follower_loop` receives and executes the same command. Inside a forward, the ranks meet at
the per-layer all-reduces of :mod:`dart_ray.parallel.tp`. Followers compute neither logits nor
taps (the residual stream is replicated, so rank 0's are the answer): the drafter never needs
anything from another process.

Several engines (e.g. Serve lanes) may share one TP group: every ``new_cache`` gets an id and the
followers keep one cache per id. Commands are serialised by a lock, so engines on different threads
cannot interleave their collectives.

Failure model: a follower whose command raises ``ValueError``/``TypeError`` logs it and continues —
the errors the engine can trigger (cache overflow, bad mask shape) are raised identically by rank 0
before any collective, so the ranks stay in step. Any other error leaves the loop (its state may now
differ from rank 0's: decoding on would be silently wrong); the follower's caller closes the group,
so rank 0's next collective fails at once and the group is marked failed. A follower that dies
makes rank 0's next collective fail (after at most the group timeout) rather than hang.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dart_ray.kv_cache import KVCache
from dart_ray.models.llama import ForwardOutput, Transformer
from dart_ray.parallel.tp import new_tp_cache

logger = logging.getLogger("dart_ray.parallel")

DEFAULT_TIMEOUT_S = 60.0
"""Bound on the rendezvous and on every collective of a running forward."""

DEFAULT_IDLE_TIMEOUT_S = 7 * 24 * 3600.0
"""How long a follower waits for the next command (an idle server sends none)."""


# ---- the process group ------------------------------------------------------------------------
@dataclass
class TPGroup:
    """This process's membership in a tensor-parallel group."""

    rank: int
    world: int
    device: torch.device
    group: Any = None
    """Process group of the all-reduces and command tensors (NCCL on CUDA, gloo on CPU); None =
    default."""
    ctrl: Any = None
    """Gloo group carrying command headers (Python objects), with the long idle timeout."""
    owns_default_group: bool = False

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def close(self) -> None:
        """Leave the group (destroys the default process group if :func:`init_tp_group` made it)."""
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_default_group = False


def local_group(device: str | torch.device = "cpu") -> TPGroup:
    """A one-rank "group" (no torch.distributed): the TP code paths with tensor_parallel_size=1."""
    return TPGroup(rank=0, world=1, device=torch.device(device))


def init_tp_group(rank: int, world: int, init_method: str, device: str | torch.device = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S,
                  idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> TPGroup:
    """Join the TP group as ``rank`` (all ranks call this; it returns once all have joined).

    ``init_method`` is ``tcp://<rank-0 host>:<port>``. The backend follows the device: NCCL for
    CUDA, gloo for CPU. Rendezvous and collectives time out after ``timeout_s``; followers wait
    up to ``idle_timeout_s`` between commands.
    """
    device = torch.device(device)
    if world == 1:
        return local_group(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; "
                           "one TP group per process")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s))
    return TPGroup(rank=rank, world=world, device=device, group=dist.group.WORLD, ctrl=ctrl,
                   owns_default_group=True)


# ---- commands ---------------------------------------------------------------------------------
def _send(tp: TPGroup, op: str, args: dict, tensors: dict[str, torch.Tensor | None]) -> None:
    present = {k: t for k, t in tensors.items() if t is not None}
    specs = {k: (tuple(t.shape), t.dtype) for k, t in present.items()}
    dist.broadcast_object_list([(op, args, specs)], src=0, group=tp.ctrl)
    for t in present.values():
        dist.broadcast(t.to(tp.device).contiguous(), src=0, group=tp.group)


def _recv(tp: TPGroup) -> tuple[str, dict, dict[str, torch.Tensor]]:
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=tp.ctrl)
    op, args, specs = box[0]
    tensors = {}
    for k, (shape, dtype) in specs.items():
        t = torch.empty(shape, dtype=dtype, device=tp.device)
        dist.broadcast(t, src=0, group=tp.group)
        tensors[k] = t
    return op, args, tensors


class Leader:
    """Rank 0's side: each command is broadcast to the followers, then run locally, under one lock.

    A command that fails for any reason other than a ``ValueError``/``TypeError`` (which every rank
    raises alike, before any collective) leaves the ranks out of step: the group is then marked
    failed and every later command raises at once (:meth:`check_health` too).
    """

    def __init__(self, tp: TPGroup) -> None:
        if tp.rank != 0:
            raise ValueError(f"the leader is rank 0, this process is rank {tp.rank}")
        self.tp = tp
        self.lock = threading.RLock()
        self.closed = False
        self.failure: BaseException | None = None
        self.caches: weakref.WeakValueDictionary[int, KVCache] = weakref.WeakValueDictionary()
        self._next_cache_id = 0

    def check_health(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the tensor-parallel group failed ({self.failure!r}); "
                               "the engine must be rebuilt") from self.failure
        if self.closed:
            raise RuntimeError("the tensor-parallel group is shut down")

    @contextlib.contextmanager
    def command(self, op: str, args: dict | None = None,
                tensors: dict | None = None) -> Iterator[None]:
        """Broadcast one command; the body executes it locally (still under the lock)."""
        with self.lock:
            self.check_health()
            try:
                if self.tp.world > 1:
                    _send(self.tp, op, args or {}, tensors or {})
                yield
            except (ValueError, TypeError):
                raise
            except BaseException as e:
                if self.tp.world > 1:
                    self.failure = e
                raise

    def new_cache_id(self) -> int:
        self._next_cache_id += 1
        return self._next_cache_id

    def shutdown(self) -> None:
        """Tell the followers to leave their loop (idempotent; a failed group is just marked
        closed)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.tp.world > 1 and self.failure is None:
                try:
                    _send(self.tp, "shutdown", {}, {})
                except Exception as e:  # noqa: BLE001 - followers already gone: nothing left to release
                    logger.warning("tensor-parallel shutdown could not reach the followers: %r", e)


class TPCacheProxy:
    """Rank 0's KV cache: the local shard, with every mutation mirrored on the followers."""

    def __init__(self, local: KVCache, cache_id: int, leader: Leader) -> None:
        self.local = local
        self.cache_id = cache_id
        self.leader = leader

    # read-only state (host-side, identical on all ranks)
    @property
    def lengths(self) -> list[int]:
        return self.local.lengths

    @property
    def max_batch(self) -> int:
        return self.local.max_batch

    @property
    def max_seq_len(self) -> int:
        return self.local.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.local.device

    # writes happen inside a forward, which every rank runs: local only
    def begin_write(self, rows: slice, num_new: int, starts: list[int] | None = None) -> int:
        return self.local.begin_write(rows, num_new, starts)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, s_used: int):
        return self.local.write(layer, k, v, s_used)

    # mirrored mutations
    def commit(self, rows: slice, path: torch.Tensor, num: list[int]) -> None:
        with self.leader.command("commit", {"cache": self.cache_id, "rows": rows, "num": list(num)},
                                 {"path": path}):
            self.local.commit(rows, path, num)

    def commit_all(self, rows: slice, num: list[int]) -> None:
        with self.leader.command("commit_all",
                                 {"cache": self.cache_id, "rows": rows, "num": list(num)}):
            self.local.commit_all(rows, num)

    def reset_row(self, r: int) -> None:
        with self.leader.command("reset_row", {"cache": self.cache_id, "r": int(r)}):
            self.local.reset_row(r)

    def move_row(self, src: int, dst: int) -> None:
        with self.leader.command("move_row",
                                 {"cache": self.cache_id, "src": int(src), "dst": int(dst)}):
            self.local.move_row(src, dst)

    def close(self) -> None:
        """Free this cache on the followers (rank 0's shard goes with this object)."""
        with self.leader.lock:
            self.leader.caches.pop(self.cache_id, None)
            if not self.leader.closed and self.leader.failure is None:
                with self.leader.command("free_cache", {"cache": self.cache_id}):
                    pass


class TPModelProxy:
    """Rank 0's model: the local shard, with every forward and cache allocation mirrored."""

    def __init__(self, model: Transformer, leader: Leader) -> None:
        if getattr(model, "tp_world", 1) != leader.tp.world:
            raise ValueError(f"model is sharded for {getattr(model, 'tp_world', 1)} ranks, the "
                             f"group has {leader.tp.world}; call apply_tensor_parallel first")
        self.model = model
        self.leader = leader

    # replicated parts: plain attributes of the local model
    @property
    def args(self):
        return self.model.args

    @property
    def embed(self):
        return self.model.embed

    @property
    def lm_head(self):
        return self.model.lm_head

    @property
    def norm(self):
        return self.model.norm

    @property
    def tp(self) -> TPGroup:
        return self.leader.tp

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden)

    def new_cache(self, max_batch: int, max_seq_len: int) -> TPCacheProxy:
        with self.leader.lock:
            cid = self.leader.new_cache_id()
            with self.leader.command("new_cache", {"cache": cid, "max_batch": int(max_batch),
                                                   "max_seq_len": int(max_seq_len)}):
                local = new_tp_cache(self.model, max_batch, max_seq_len)
            self.leader.caches[cid] = local
            return TPCacheProxy(local, cid, self.leader)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: TPCacheProxy, rows: slice | None = None, starts: list[int] | None = None,
                taps: tuple[int, ...] = (), logits_at: torch.Tensor | None = None,
                return_logits: bool = True) -> ForwardOutput:
        if not isinstance(cache, TPCacheProxy) or cache.leader is not self.leader:
            raise TypeError("a tensor-parallel forward needs a cache made by this model's "
                            "new_cache")
        with self.leader.command("forward", {"cache": cache.cache_id, "rows": rows,
                                             "starts": None if starts is None
                                             else [int(s) for s in starts]},
                                 {"tokens": tokens, "positions": positions, "mask": mask}):
            return self.model(tokens, positions, mask, cache.local, rows=rows, starts=starts,
                              taps=taps, logits_at=logits_at, return_logits=return_logits)

    __call__ = forward

    def rank_lengths(self) -> list[dict[int, list[int]]]:
        """Every rank's committed lengths per cache id (rank order) — a lockstep self-check."""
        with self.leader.command("report"):
            return _gather_report(self.leader.tp, dict(self.leader.caches))

    def check_health(self) -> None:
        """Raise if the group failed (a follower died, a collective timed out) or was shut down."""
        self.leader.check_health()

    def shutdown(self) -> None:
        """Release the followers (they return from :func:`follower_loop`); idempotent."""
        self.leader.shutdown()


def _gather_report(tp: TPGroup, caches: dict[int, KVCache]) -> list:
    mine = {cid: list(c.lengths) for cid, c in caches.items()}
    if tp.world == 1:
        return [mine]
    out: list = [None] * tp.world
    dist.all_gather_object(out, mine, group=tp.ctrl)
    return out


# ---- followers --------------------------------------------------------------------------------
def follower_loop(model: Transformer, tp: TPGroup) -> int:
    """Execute rank 0's commands on this rank's shard until ``shutdown``; returns the count run."""
    if tp.rank == 0:
        raise ValueError("rank 0 leads; follower_loop runs on ranks 1..N-1")
    caches: dict[int, KVCache] = {}
    count = 0
    while True:
        op, a, t = _recv(tp)
        if op == "shutdown":
            return count
        count += 1
        if op == "report":
            _gather_report(tp, caches)
            continue
        try:
            if op == "forward":
                model(t["tokens"], t["positions"], t.get("mask"), caches[a["cache"]],
                      rows=a["rows"], starts=a["starts"], taps=(), return_logits=False)
            elif op == "commit":
                caches[a["cache"]].commit(a["rows"], t["path"], a["num"])
            elif op == "commit_all":
                caches[a["cache"]].commit_all(a["rows"], a["num"])
            elif op == "reset_row":
                caches[a["cache"]].reset_row(a["r"])
            elif op == "move_row":
                caches[a["cache"]].move_row(a["src"], a["dst"])
            elif op == "new_cache":
                caches[a["cache"]] = new_tp_cache(model, a["max_batch"], a["max_seq_len"])
            elif op == "free_cache":
                caches.pop(a["cache"], None)
            else:
                raise ValueError(f"unknown tensor-parallel command {op!r}")
        except (ValueError, TypeError):
            # rank 0 raises the same error for the same state (its Leader.command keeps the
            # group for these too): stay in the loop
            logger.exception("rank %d: command %r failed (pid %d)", tp.rank, op, os.getpid())
        except Exception as e:
            # anything else happened here alone: this shard's state may now differ from rank
            # 0's, and a shard that decodes on would make the output silently wrong. Leave: the
            # caller closes the group, so rank 0's next collective fails at once
            logger.exception("rank %d: command %r failed (pid %d); leaving the group", tp.rank,
                             op, os.getpid())
            raise RuntimeError(f"tensor-parallel rank {tp.rank}: command {op!r} failed: "
                               f"{type(e).__name__}: {e}") from e
