"""A sampled request's randomness, keyed by output position.

Sampling draws the token at output position ``k`` (0 = the first generated token) by inverting the
target's processed CDF at one uniform ``u(seed, k)``. The uniform is a hash of the request's seed
and the position (SplitMix64's finaliser), not the next number of a stream, so it does not depend
on how many draft nodes a step tried, how large the tree was, which method drafted, or which other
requests shared the batch. Hence, for a request with a seed:

* its output is reproducible whatever the batch, the tree schedule (adaptive or not) and the
  method -- speculative decoding with any drafter emits the tokens plain sampling emits with the
  same seed (up to floating-point differences between the forwards at a CDF boundary);
* verification stays exact: a draft node is accepted iff its token is the one the target draws at
  that position, so every emitted token is exactly the target's sample given its prefix.

Deterministic drafts (every method but SpS) are accepted with probability ``sum p(x)`` over a
node's distinct children, the same as recursive rejection sampling gives for point-mass drafts.
Sampled drafts (SpS, ``tree.draft_probs``) keep the rule of Leviathan et al. and draw from the
request's sequential :attr:`RequestRandom.generator`; their output is reproducible for a fixed
tree schedule only.
"""

from __future__ import annotations

import random

import torch

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit ints with good avalanche."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
    return z ^ (z >> 31)


class RequestRandom:
    """One sampled request's random numbers: position-keyed uniforms, and a sequential generator
    for drafters that sample their drafts (SpS)."""

    __slots__ = ("seed", "_key", "_generator", "_device")

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.seed = int(seed) if seed is not None else random.getrandbits(63)
        """The request's seed (``SamplingParams.seed``, or drawn at random when it has none)."""
        self._key = _mix((self.seed & _M64) ^ _GOLDEN)
        self._generator: torch.Generator | None = None
        self._device = device

    def uniform(self, position: int) -> float:
        """The uniform in [0, 1) of output position ``position``."""
        if position < 0:
            raise ValueError(f"position {position} < 0")
        z = _mix((self._key + ((position << 8) + 1) * _GOLDEN) & _M64)
        return (z >> 11) * (1.0 / (1 << 53))

    @property
    def generator(self) -> torch.Generator:
        """A torch generator seeded with :attr:`seed`, consumed in order (sampled drafts)."""
        if self._generator is None:
            self._generator = torch.Generator(device=self._device)
            self._generator.manual_seed(self.seed & ((1 << 63) - 1))
        return self._generator
