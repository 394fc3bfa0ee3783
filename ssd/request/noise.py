"""Shared noise: the draws of a seeded request as a function of (seed, position, token id)
alone, so that whoever computes them (the target, a draft, another process or device) gets the
same values (docs/exactness.md, "Seeds and generators").

A token is drawn from p by the exponential race, argmax_v p(v) / E(v) with E(v) ~ Exp(1)
(equivalently Gumbel-max: argmax_v log p(v) + G(v)). Here E(v) = -log(1 - W(v)), where W(v) is a
31-bit uniform from a hash of the seed, the token's absolute position in the sequence and v.
The target's token at a position is then its own race's winner whatever was drafted; a draft
that races its own q with the same noise proposes the same token with probability at least
(1 - TV) / (1 + TV) (Daliri, Musco and Suresh, arXiv 2408.07978), and verification is
equality: drafter-invariant speculative decoding.

The hash is Wellons' lowbias32 on int32 tensors (multiplication wraps modulo 2**32; shifts
are made logical by a mask), over each token id times an odd constant plus the row's key.
"""
import threading
from dataclasses import dataclass

import torch

from ssd.sampling_params import SamplingParams

# How seeded sampled requests draw (EngineConfig.seeded_sampling): "shared-noise" by this
# module's noise, so the same tokens in every mode, at any K, beside any batch; "rejection" from
# the request's own generator, verified by rejection sampling (the same tokens at a fixed K).
SEEDED_SAMPLING = ("shared-noise", "rejection")

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # odd: ids times it are distinct modulo 2**32
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


def _int32(x: int) -> int:
    """x modulo 2**32 as a signed 32-bit value (what an int32 tensor holds)."""
    x &= _M32
    return x - (1 << 32) if x >= 1 << 31 else x


def _mix(x: int) -> int:
    """lowbias32 on a Python int (the row keys)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _hash(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on an int32 tensor, in place (bit for bit _mix); tmp: scratch of
    x's shape. (Shifts are arithmetic on int32: the masks make them logical.)"""
    torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
    x.bitwise_xor_(tmp).mul_(_int32(_C1))
    torch.bitwise_right_shift(x, 15, out=tmp).bitwise_and_(0x1FFFF)
    x.bitwise_xor_(tmp).mul_(_int32(_C2))
    torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
    return x.bitwise_xor_(tmp)


def _exponentials(x: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Exp(1) values (float32, into out) from x (int32: spread ids plus a row key), hashed in
    place; tmp: int32 scratch of x's shape."""
    _hash(x, tmp)
    torch.bitwise_right_shift(x, 1, out=tmp).bitwise_and_(0x7FFFFFFF)
    # E = -log(1 - W), W = (bits + 1/2) / 2**31 in (0, 1): log1p keeps the small values of E
    # (where a token far less likely than the others wins) as fine as W's 31 bits; -log(U)
    # of a U near 1 would round them to a float32 step near 1 (6e-8), and a tail token that
    # needs a smaller E would never win.
    return out.copy_(tmp).add_(0.5).mul_(-2.0 ** -31).log1p_().neg_()


def keyed_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """p / E for rows of probabilities [N, V], row i's E keyed by keys[i] (int32, any values):
    the race of a draw that needs no seed of its own (sampler.sample)."""
    width, device = probs.shape[-1], probs.device
    if probs.shape[0] == 1:
        x, tmp, out = _SCRATCH.get(width, device)
        torch.add(_spread(width, device), keys[0], out=x)
        return probs.float() / _exponentials(x, tmp, out)
    x = _spread(width, device).unsqueeze(0) + keys.unsqueeze(1)
    return probs.float() / _exponentials(x, torch.empty_like(x), torch.empty(x.shape, device=device))


class _Scratch(threading.local):
    """A thread's buffers for one row's noise, per width and device (a row's eight passes over
    the vocabulary then allocate nothing; per thread, as an SSD worker may run as a thread)."""

    def __init__(self):
        self.rows: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (width, torch.device(device))
        if key not in self.rows:
            # Normal tensors even when first asked for under inference_mode (a draft's pass): those
            # updated in place outside it would be refused.
            with torch.inference_mode(False):
                self.rows[key] = (torch.empty(width, dtype=torch.int32, device=device),
                                  torch.empty(width, dtype=torch.int32, device=device),
                                  torch.empty(width, device=device))
        return self.rows[key]


_SCRATCH = _Scratch()


_SPREAD: dict[tuple[int, torch.device], torch.Tensor] = {}


def _spread(width: int, device: torch.device) -> torch.Tensor:
    """Token ids 0..width-1 times _GOLDEN modulo 2**32 (int32), kept per width and device."""
    key = (width, torch.device(device))
    if key not in _SPREAD:
        ids = torch.arange(width, dtype=torch.int64, device=device)
        _SPREAD[key] = ((ids * _GOLDEN) & _M32).to(torch.int32)
    return _SPREAD[key]


@dataclass(frozen=True)
class SharedNoise:
    """One seeded request's noise: Exp(1) values keyed by (seed, position, token id)."""

    seed: int

    def key(self, position: int) -> int:
        """A row's 32-bit key from the 64-bit seed and the position."""
        k = _mix(_mix(self.seed & _M32) ^ (self.seed >> 32) ^ 0x5BD1E995)
        return _mix(k ^ _mix(position + 0x68E31DA4))

    def race(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """p / E for one row of probabilities [V] over token ids 0..V-1, E the Exp(1) values at
        `position`: its argmax is the row's draw there. Each row is computed alone, so its bits
        do not depend on which rows are computed with it."""
        x, tmp, out = _SCRATCH.get(probs.shape[-1], probs.device)
        torch.add(_spread(probs.shape[-1], probs.device), _int32(self.key(position)), out=x)
        return probs.float() / _exponentials(x, tmp, out)

    def choose(self, probs: torch.Tensor, positions: list[int]) -> list[int]:
        """One token per row of probs [N, V]: row i's draw at positions[i]."""
        return [first_argmax(self.race(row, pos)) for row, pos in zip(probs, positions)]

    def ranked(self, probs: torch.Tensor, position: int, n: int) -> list[int]:
        """The n tokens of one row [V] that lead its race at `position`, its draw first: where a
        target's draw differs from a draft's, most often the draft's runner-up."""
        return self.race(probs, position).topk(n).indices.tolist()


_BLOCK = 1024


def first_argmax(x: torch.Tensor) -> int:
    """x.argmax() of a 1-D tensor (the first of equal maxima), by blocks' maxima on a CPU: a
    max reduction is vectorised there and argmax is not (a fifth of the time on a 151,936-token
    row)."""
    if x.is_cuda or x.numel() < 2 * _BLOCK:
        return int(x.argmax())
    whole = x.numel() - x.numel() % _BLOCK
    tops = x[:whole].view(-1, _BLOCK).amax(1)
    b = int(tops.argmax())
    if whole < x.numel() and bool(x[whole:].max() > tops[b]):  # (a tie goes to the earlier block)
        return whole + int(x[whole:].argmax())
    return b * _BLOCK + int(x[b * _BLOCK:(b + 1) * _BLOCK].argmax())


def request_noise(params: SamplingParams, seeded_sampling: str) -> SharedNoise | None:
    """The shared noise a request draws with: a seeded sampled request's under "shared-noise",
    else None (greedy requests draw nothing; the others use generators)."""
    if seeded_sampling != "shared-noise" or params.greedy_decoding or params.seed is None:
        return None
    return SharedNoise(params.seed)
