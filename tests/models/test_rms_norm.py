"""RMSNorm's CPU inference path (layer norm over [x, -x]) equals ``F.rms_norm``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dart_ray.models.llama import RMSNorm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_inference_path_equals_rms_norm(dtype, tol):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype) * 4
    x[0, 0] = 0                                                  # an all-zero row: eps only
    x[1, 1] += 7                                                 # a large mean: not subtracted
    ref = F.rms_norm(x.float(), (64,), norm.weight.float(), 1e-5)
    with torch.inference_mode():
        got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    # the doubled weight follows an in-place weight update (weights loaded after construction)
    with torch.no_grad():
        norm.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x).float(), 2 * ref, rtol=2 * tol, atol=2 * tol)


def test_training_path_keeps_autograd():
    norm = RMSNorm(8, 1e-5)
    x = torch.randn(2, 8, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_weights_made_under_inference_mode():
    """Inference tensors have no version counter; the norm still follows their updates."""
    x = torch.randn(2, 8)
    with torch.inference_mode():
        norm = RMSNorm(8, 1e-5)
        first = norm(x)
        norm.weight.mul_(3)
        torch.testing.assert_close(norm(x), 3 * first)
    torch.testing.assert_close(first, F.rms_norm(x, (8,), torch.ones(8), 1e-5))
