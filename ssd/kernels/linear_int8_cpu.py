"""Batch-invariant weight-only int8 CPU linear: ``y = (x @ Wq.T) * scale (+ b)``.

For a draft model, whose numerics change only how often its guesses are accepted, never
the output: int8 weights are 4x fewer bytes than fp32 to stream from memory per token.
Wq is int8 [N, K] with one symmetric fp32 scale per output row (:func:`quantize`); x, b
and y are fp32. Every int8 weight converts exactly to fp32 and is FMA'd in fp32, in one
fixed order whatever M, the other rows of x or the thread count (so the draft's logits
for a tree of branches equal those of decoding each branch alone):

    lane j (0..15) of output (m, n) accumulates fma(x[m,k], float(Wq[n,k]), lane) over
    k = j, j+16, j+32, ... (ascending) for k < K16 = K - K % 16, starting from 0;
    the K % 16 tail elements k = K16 + j go into lane j (fma);
    s_j = l_j + l_{j+8} (j < 8); s = ((s0+s4) + (s2+s6)) + ((s1+s5) + (s3+s7));
    y = s * scale[n], then + b[n].

Sixteen lanes so that AVX-512 converts and FMAs one full zmm per 16 weights; the AVX2 and
portable builds run lanes 0-7 and 8-15 as two 8-float halves. All three builds
(``avx512``, ``avx2``, ``portable``, picked as in ssd/kernels/linear_cpu.py) do the same
operations in the same order: they give the same bits.

Speed at the small M of decoding (memory-bound): threads split N; up to M = 12 (AVX-512;
6 on AVX2) one register tile holds every row of x, so each weight byte is read from
memory and converted once per call and FMA'd into all M rows. Larger M (draft trees) is
compute-bound: each L1-sized chunk of a few rows of Wq is converted once into an fp32
buffer that several register tiles of x then read. Software prefetch keeps DRAM busy
while the cores convert. See `bench/linear_kernel.py --compare int8`.

Built lazily from ssd/kernels/csrc/linear_int8.cpp by ssd/kernels/build.py (nothing at
import). If the kernel cannot run (no compiler, ``SSD_CPU_KERNELS=off``, CUDA or non-fp32
tensors), :func:`linear_int8` computes ``(x @ Wq.T) * scale (+ b)`` with stock torch ops
in x's dtype: slower, and for fp32 on the CPU still batch-invariant (one row at a time,
ssd/kernels/fallback.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ssd.kernels.build import VARIANTS, CppKernel, default_variant, runnable_variants
from ssd.kernels.fallback import rows_apart

__all__ = ["VARIANTS", "available", "default_variant", "get_op", "linear_int8", "quantize",
           "runnable_variants"]


_KERNEL = CppKernel("linear_int8")
_F32 = torch.float32


def get_op(variant: str | None = None):
    """The compiled op ``op(x2d, qweight, scale, b_or_None) -> y`` for a variant (default:
    this machine's), building it on first use; None if it cannot be built. Never raises."""
    return _KERNEL.op("linear_int8", variant)


def available(variant: str | None = None) -> bool:
    """Whether the kernel can run here (builds it on first call)."""
    return get_op(variant) is not None


@torch.no_grad()
def quantize(weight: torch.Tensor, rows_per_step: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(qweight int8 [N, K], scale fp32 [N])`` with
    ``weight ~= qweight * scale[:, None]``, scale = max|row| / 127 (0 for a zero row)."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=_F32, device=weight.device)
    # one reused block buffer: fresh full-size temporaries would cost memory and, on the
    # CPU, more time in page faults than in arithmetic
    buf = torch.empty((min(rows_per_step, weight.shape[0]), weight.shape[1]), dtype=_F32,
                      device=weight.device)
    for i in range(0, weight.shape[0], rows_per_step):
        w = weight[i:i + rows_per_step]
        t = buf[:w.shape[0]]
        s = torch.amax(t.copy_(w).abs_(), dim=1) / 127
        scale[i:i + rows_per_step] = s
        t.copy_(w).div_(torch.where(s > 0, s, 1)[:, None])
        q[i:i + rows_per_step] = t.round_().clamp_(-127, 127)
    return q, scale


def supported(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear_int8` would use the kernel for these tensors (CPU, fp32 x)."""
    return (x.dtype is _F32 and qweight.dtype is torch.int8 and scale.dtype is _F32
            and x.is_cpu and qweight.is_cpu and scale.is_cpu and qweight.dim() == 2
            and (bias is None or (bias.dtype is _F32 and bias.is_cpu)))


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, variant: str | None = None) -> torch.Tensor:
    """``(x @ qweight.T) * scale (+ bias)``, batch-invariant when x is fp32 on the CPU: by the
    kernel, or where it cannot run here by stock torch ops on each row alone. Other tensors
    (CUDA, bf16) by stock torch ops in x's dtype. x: [..., K]."""
    fits = supported(x, qweight, scale, bias)
    op = get_op(variant) if fits else None
    if op is None:
        # int8 values are exact in fp16/bf16/fp32, so only the matmul itself rounds
        w = qweight.to(x.dtype)
        if fits:  # no kernel here
            y = rows_apart(lambda row: F.linear(row, w), x.reshape(-1, x.shape[-1]))
            y = y.view(*x.shape[:-1], qweight.shape[0])
        else:
            y = F.linear(x, w)
        y = y * scale.to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if qweight.stride(-1) != 1:
        qweight = qweight.contiguous()
    scale = scale.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    y = op(x2, qweight, scale, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], qweight.shape[0])
