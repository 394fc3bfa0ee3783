"""Fused CPU steps of a decoder layer (csrc/fused.cpp): RMSNorm, and RoPE with the KV-cache write.

Why: with quantised weights a decode step of a small model spends a tenth or more of its time
dispatching the dozen torch calls of its glue, per layer (docs/decision-log.md, "Per-layer
overhead"). One op each for these two steps removes most of them. Rows are computed
independently in a fixed order (batch-invariant); RoPE gives the bits of the torch expression
it replaces, RMSNorm sums in its own fixed order (close to torch's, not equal to it).

`rms_norm` and `rope_cache` return None where the kernel does not apply (CUDA, not fp32, or no
build), and the caller uses torch: on the CPU in fp32, RMSNorm one row at a time (batch-invariant,
ssd/kernels/fallback.py); RoPE's torch expression is elementwise, so batch-invariant as it is.
"""
from __future__ import annotations

import torch

from ssd.kernels.build import CppKernel

_KERNEL = CppKernel("fused")
_F32 = torch.float32


def get_op(name: str, variant: str | None = None):
    return _KERNEL.op(name, variant)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    if not (x.is_cpu and x.dtype is _F32 and weight.dtype is _F32 and x.is_contiguous()):
        return None
    op = get_op("rms_norm")
    return None if op is None else op(x, weight, eps)


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
               ) -> torch.Tensor | None:
    """q rotated by its positions; k rotated and v written into the cache at `slots`."""
    if not (q.is_cpu and q.dtype is _F32 and k_cache.dtype is _F32 and cos.dtype is _F32):
        return None
    op = get_op("rope_cache")
    return None if op is None else op(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
