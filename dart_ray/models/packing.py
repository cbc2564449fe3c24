"""CPU weight packing: a transform that swaps ``nn.Linear`` for oneDNN-prepacked linears.

On CPU a bf16 ``F.linear`` reads its row-major weight and reorders it on every call; at batch 1
the decode step is a chain of memory-bound GEMVs, and that reorder costs about a third of the
step. oneDNN can reorder once, ahead of time, into its blocked layout (the same thing inductor
does under ``freezing``). Measured on this project's 2-core Xeon (AMX/avx512_bf16) for the
SmolLM2-135M shapes: the 121 linears of one decode step take 18.9 ms plain and 12.1 ms packed at
M=1, and 28 ms vs 23 ms at M=61 (a verify tree). In fp32 the answer depends on the machine: slower
packed at M=1 on that Xeon, much faster on an AVX2-only EPYC, where MKL's dense small-M GEMMs are
poor (SmolLM2's LM head at 2..9 rows: 22-30 ms dense vs 5-8 ms packed). So fp32 is packed where
a short measurement says it helps (:func:`fp32_packing_helps`).

Like tensor parallelism, this is a transform applied to a built model (``pack_linears(model)``),
never a change to the model code. Packed modules are inference-only (no autograd); their dense
weight stays readable through ``.weight`` (a reorder back, for the rare construction-time reader).
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

PACK_BATCH_HINT = 64
"""Rows oneDNN is told to expect when choosing the blocked layout. Measured for SmolLM2 shapes:
hint 64 is within noise of hint 1 at M=1 and M=8 (12.4 vs 12.1 ms per step) and clearly better at
M=61 (22.9 vs 26.3 ms) and M=256 (41.5 vs 46.9 ms), so one layout serves AR, trees and prefill."""


def packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Can oneDNN prepack linears here: CPU, oneDNN, and fp32 or natively supported bf16."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where packing is available and helps: bf16 always (measured on AMX: 18.9 -> 12.1 ms per
    step); fp32 where a short measurement on this machine says so (:func:`fp32_packing_helps`)."""
    if not packing_available(device, dtype):
        return False
    return dtype == torch.bfloat16 or fp32_packing_helps()


def _time(f, reps: int = 7) -> float:
    for _ in range(2):
        f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_fp32_packing() -> dict[str, float]:
    """Seconds of an MLP-sized fp32 linear (3072 x 576), dense and packed, at 1 row (a decode step)
    and 9 rows (a small draft tree)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 576, generator=g)
    packed = PackedLinear(w, None)
    out = {}
    with torch.inference_mode():
        for rows in (1, 9):
            x = torch.randn(rows, 576, generator=g)
            out[f"dense_{rows}"] = _time(functools.partial(torch.nn.functional.linear, x, w))
            out[f"packed_{rows}"] = _time(functools.partial(packed, x))
    return out


def fp32_packing_helps() -> bool:
    """Measured once per hardware fingerprint (cached under ``$DART_RAY_CACHE/hardware``): is the
    packed fp32 linear faster than the dense one, summed over 1 and 9 rows? On an AVX2 EPYC it is
    (SmolLM2's 3072 x 576: 0.24 -> 0.20 ms at 1 row, 0.78 -> 0.51 ms at 9; its LM head 10 -> 6 ms
    at 1 row, 30 -> 8 ms at 9); on the AMX Xeon it was slower at 1 row."""
    from dart_ray.hardware import Fingerprint, read_cached, write_cached

    name = f"pack-fp32-{Fingerprint.current('cpu', 'fp32').key()}.json"
    t = read_cached(name, ("dense_1", "dense_9", "packed_1", "packed_9"))
    if t is None:
        t = measure_fp32_packing()
        write_cached(name, t)
    return t["packed_1"] + t["packed_9"] < t["dense_1"] + t["dense_9"]


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout (CPU inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 batch_hint: int = PACK_BATCH_HINT, keep_dense: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        """The weight's dtype, which inputs must have (a packed tensor is opaque)."""
        # opaque [O, I]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach()
        # a tied weight (LM head = embedding) is alive anyway: keep the reference, it costs nothing
        # (kept outside nn.Module's registries: it is not this module's parameter)
        self.__dict__["_dense"] = weight if keep_dense else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, batch_hint: int = PACK_BATCH_HINT,
                    keep_dense: bool = False) -> PackedLinear:
        return cls(lin.weight, lin.bias, batch_hint, keep_dense)

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight: the tied tensor itself, else a reorder back (not for the
        hot path)."""
        return self._dense if self._dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear is inference-only (no autograd through packed "
                               "weights)")
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed,
                                               self.bias,
                                               "none", [], "")            # [N, out]
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def pack_linears(module: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> int:
    """Replace every plain bf16/fp32 CPU ``nn.Linear`` under ``module`` (in place) by a
    :class:`PackedLinear`.

    Idempotent (already packed and custom linear subclasses such as the TP ones are left alone).
    Returns the number of modules replaced. The caller checks :func:`packing_supported` first.
    """
    linears = [(p, name, c) for p in list(module.modules()) for name, c in p.named_children()
               if type(c) is nn.Linear and c.weight.dtype in (torch.bfloat16, torch.float32)
               and c.weight.device.type == "cpu"]
    # weights also owned by a non-linear module (a tied LM head) stay referenced after packing
    shared = {id(t) for m in module.modules() if type(m) is not nn.Linear
              for t in m.parameters(recurse=False)}
    for parent, name, child in linears:
        setattr(parent, name,
                PackedLinear.from_linear(child, batch_hint, keep_dense=id(child.weight) in shared))
    return len(linears)


WARM_ROWS = 64
"""Row counts :func:`warm_packed` prepares at least (the engine asks for more where its verify tree
can be larger): a decode step, DART's drafter forward (its pending context plus mask slots) and the
trees the controller picks on a CPU at bs 1 (up to ~24 nodes on the Zen 4 and Zen 5)."""


def warm_packed(modules: list[nn.Module], rows: range = range(1, WARM_ROWS + 1)) -> int:
    """Call one :class:`PackedLinear` of every distinct shape under ``modules`` once at each row
    count in ``rows``, so none is first met in a timed step.

    oneDNN builds a kernel for each (weight shape, rows) on first use and caches it: 0.45-0.6 ms
    per call the first time against 0.05-0.1 ms after (a 576 -> 3072 bf16 linear, 2 Zen 5 cores).
    A tree size, or a drafter context length, not met before then costs ~2-3 ms once per linear
    shape -- DART's first drafter forwards in a process ran at 5 ms against 2.5 ms after, and the
    adaptive controller learned those prices. Layers of equal shape share kernels, so one module
    per shape is called. Returns the number of calls made (8 shapes x 81 rows for SmolLM2 and
    DART at the default knobs: 648 calls, 0.75 s on 2 Zen 5 cores). The kernels stay in oneDNN's
    primitive cache (1,024 entries by default, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; least recently
    used out), which a much larger model or long-running batch shapes may cycle through."""
    distinct: dict[tuple, PackedLinear] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, PackedLinear):
                distinct.setdefault((m.in_features, m.out_features, m.bias is not None, m.dtype),
                                    m)
    calls = 0
    with torch.inference_mode():
        for lin in distinct.values():
            for n in rows:
                lin(torch.zeros(n, lin.in_features, dtype=lin.dtype))
                calls += 1
    return calls
