"""CPU weight packing: a transform that swaps ``nn.Linear`` for oneDNN-prepacked linears.

On CPU a bf16 ``F.linear`` reads its row-major weight and reorders it on every call; at batch 1
the decode step is a chain of memory-bound GEMVs, and that reorder costs about a third of the
step. oneDNN can reorder once, ahead of time, into its blocked layout (the same thing inductor
does under ``freezing``). Measured on this project's 2-core Xeon (AMX/avx512_bf16) for the
SmolLM2-135M shapes: the 121 linears of one decode step take 18.9 ms plain and 12.1 ms packed at
M=1, and 28 ms vs 23 ms at M=61 (a verify tree). fp32 is *slower* packed at M=1, so packing is
only applied to bf16.

Like tensor parallelism, this is a transform applied to a built model (``pack_linears(model)``),
never a change to the model code. Packed modules are inference-only (no autograd); their dense
weight stays readable through ``.weight`` (a reorder back, for the rare construction-time reader).
"""

from __future__ import annotations

import torch
from torch import nn

PACK_BATCH_HINT = 64
"""Rows oneDNN is told to expect when choosing the blocked layout. Measured for SmolLM2 shapes:
hint 64 is within noise of hint 1 at M=1 and M=8 (12.4 vs 12.1 ms per step) and clearly better at
M=61 (22.9 vs 26.3 ms) and M=256 (41.5 vs 46.9 ms), so one layout serves AR, trees and prefill."""


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where packing is both available and measured to help: CPU, bf16, oneDNN with bf16."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W held in oneDNN's blocked layout (CPU inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = PACK_BATCH_HINT,
                 keep_dense: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)  # opaque [O, I]
        self.bias = None if bias is None else bias.detach()
        # a tied weight (LM head = embedding) is alive anyway: keep the reference, it costs nothing
        # (kept outside nn.Module's registries: it is not this module's parameter)
        self.__dict__["_dense"] = weight if keep_dense else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, batch_hint: int = PACK_BATCH_HINT, keep_dense: bool = False) -> PackedLinear:
        return cls(lin.weight, lin.bias, batch_hint, keep_dense)

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight: the tied tensor itself, else a reorder back (not for the hot path)."""
        return self._dense if self._dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear is inference-only (no autograd through packed weights)")
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")            # [N, out]
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> int:
    """Replace every plain bf16 CPU ``nn.Linear`` under ``module`` (in place) by a :class:`PackedLinear`.

    Idempotent (already packed and custom linear subclasses such as the TP ones are left alone).
    Returns the number of modules replaced. The caller checks :func:`packing_supported` first.
    """
    linears = [(p, name, c) for p in list(module.modules()) for name, c in p.named_children()
               if type(c) is nn.Linear and c.weight.dtype == torch.bfloat16 and c.weight.device.type == "cpu"]
    # weights also owned by a non-linear module (a tied LM head) stay referenced after packing
    shared = {id(t) for m in module.modules() if type(m) is not nn.Linear for t in m.parameters(recurse=False)}
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear.from_linear(child, batch_hint, keep_dense=id(child.weight) in shared))
    return len(linears)
