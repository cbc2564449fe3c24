"""A sampled request's randomness, keyed by output position.

Sampling draws the token at output position ``k`` (0 = the first generated token) by an
exponential race: every vocabulary entry i gets an Exp(1) variate ``E_i(seed, k)`` and the token is
``argmax_i p_i / E_i``, which is i with probability ``p_i / sum p`` (the Gumbel-max trick in another
form). The variates come from a generator seeded with a hash of the request's seed and the position
(SplitMix64's finaliser), not from the next numbers of a stream, so they do not depend on how many
draft nodes a step tried, how large the tree was, which method drafted, or which other requests
shared the batch. Hence, for a request with a seed:

* its output is reproducible whatever the batch, the tree schedule (adaptive or not) and the
  method -- speculative decoding with any drafter emits the tokens plain sampling emits with the
  same seed. Floating-point differences between forwards of other shapes move the drawn token
  only where the two best ``p_i / E_i`` nearly tie, as rare as a greedy near-tie. (The inverse CDF
  the race replaced flipped far more often: a token's interval there sits on the sum of every
  probability before it in vocabulary order, so rounding anywhere below it moved its edges.)
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
    """One sampled request's random numbers: position-keyed race variates, and a sequential
    generator for drafters that sample their drafts (SpS)."""

    __slots__ = ("seed", "_key", "_generator", "_device")

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.seed = int(seed) if seed is not None else random.getrandbits(63)
        """The request's seed (``SamplingParams.seed``, or drawn at random when it has none)."""
        self._key = _mix((self.seed & _M64) ^ _GOLDEN)
        self._generator: torch.Generator | None = None
        self._device = device

    def _position_key(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"position {position} < 0")
        return _mix((self._key + ((position << 8) + 1) * _GOLDEN) & _M64)

    def exponentials(self, position: int, n: int, device: torch.device | str = "cpu"
                     ) -> torch.Tensor:
        """``[n]`` float32 Exp(1) variates of output position ``position``, one per vocabulary
        entry: the race that draws the position's token (:func:`race`). The same for a position
        whatever else happened (a generator seeded with the position's key, on ``device``)."""
        g = torch.Generator(device=device)
        g.manual_seed(self._position_key(position) >> 1)          # 63 bits
        return torch.rand(n, generator=g, device=device).log_().neg_()

    @property
    def generator(self) -> torch.Generator:
        """A torch generator seeded with :attr:`seed`, consumed in order (sampled drafts)."""
        if self._generator is None:
            self._generator = torch.Generator(device=self._device)
            self._generator.manual_seed(self.seed & ((1 << 63) - 1))
        return self._generator


def race(probs: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` (unnormalised) probabilities and ``[B, V]`` Exp(1) variates -> ``[B]`` tokens:
    ``argmax p_i / E_i``, i.e. token i with probability ``p_i / sum p`` (entries with p = 0 never
    win)."""
    p = probs.float()
    # torch.rand gives exactly 0 once in 2**24, i.e. E = inf and p / E = 0: where that hits every
    # entry with p > 0 (top_k = 1, a peaked softmax) the argmax would fall to index 0, p = 0
    return torch.where(p > 0, p / exps, -1.0).argmax(dim=-1)
