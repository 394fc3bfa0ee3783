"""Batch-invariant fp32 CPU linear kernel: ``y = x @ W.T (+ b)``.

Why: exact speculative decoding needs row ``m`` of a linear layer to come out bit for bit
the same whether the target scores 1 token (decode, M=1) or K+1 tokens (verify), and
torch's ``F.linear`` picks gemv or gemm paths by M, with different summation orders. This
kernel fixes the order of every reduction, whatever M, the other rows or the thread count:

    lane j (0..7) of output (m, n) accumulates fma(x[m,k], W[n,k], lane) over
    k = j, j+8, j+16, ... (ascending) for k < K8 = K - K % 8, starting from 0;
    the K % 8 tail elements k = K8 + j go into lane j (fma);
    y = ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), then + b[n].

It is also fast for small M: each call reads W once (register tiles of up to 4 rows of x,
8 with AVX-512, share every load of W), so scoring 5 tokens costs little more than
scoring 1 on a memory-bound CPU.

The C++ source (ssd/kernels/csrc/linear.cpp) is built on first use by ssd/kernels/build.py
for the best ISA the CPU has: ``avx512`` (AVX-512F/DQ: two rows of x per zmm, each half
doing exactly the 8-lane AVX2 arithmetic), ``avx2`` (AVX2 + FMA) or ``portable`` (plain
C++, std::fma). All three perform the same operations in the same order: they give the
same bits. If no build is possible, :func:`available` is False and :func:`linear` computes
each row alone with ``F.linear`` (ssd/kernels/fallback.py: batch-invariant too, slower).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ssd.kernels.build import VARIANTS, CppKernel, default_variant, runnable_variants
from ssd.kernels.fallback import rows_apart

__all__ = ["VARIANTS", "available", "default_variant", "get_op", "linear", "runnable_variants"]


# fp16 weights are widened with F16C's vcvtph2ps (every AVX2 CPU has it).
_KERNEL = CppKernel("linear", requires={"avx512": ({"f16c"}, ["-mf16c"]), "avx2": ({"f16c"}, ["-mf16c"])})


def get_op(variant: str | None = None):
    """The compiled op ``op(x2d, w, b_or_None) -> y`` for a variant (default: this
    machine's), building it on first use; None if it cannot be built. Never raises."""
    return _KERNEL.op("linear", variant)


def available(variant: str | None = None) -> bool:
    """Whether the kernel can run here (builds it on first call)."""
    return get_op(variant) is not None


class _LinearFn(torch.autograd.Function):
    """The kernel forward with a plain backward, for the rare call that needs gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, op):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return op(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return g @ weight, g.t() @ x, (g.sum(0) if ctx.has_bias else None), None


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` would use the kernel for these tensors (CPU, fp32 x and bias;
    fp32, fp16 or bf16 weights, read as the fp32 values they hold)."""
    return (x.dtype is _F32 and weight.dtype in _WEIGHT_DTYPES and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and (bias is None or (bias.dtype is _F32 and bias.is_cpu)))


_F32 = torch.float32
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           variant: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, batch-invariant when x is fp32 on the CPU (the weight fp32,
    or fp16 / bf16 computed as its fp32 values: the same bits as its fp32 copy): by the kernel,
    or where it cannot run here by ``F.linear`` on each row alone. Other tensors (CUDA, bf16
    activations) go to ``F.linear``. x: [..., K]."""
    if not supported(x, weight, bias):
        return F.linear(x, weight, bias)
    op = get_op(variant)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if op is None:
        w = weight.float()  # (a copy for fp16 / bf16: their exact fp32 values)
        y = rows_apart(lambda row: F.linear(row, w, bias), x2)
    else:
        y = _run(op, x2, weight, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def _run(op, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel on x2 [M, K], with the backward of _LinearFn where gradients are wanted."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if torch.is_grad_enabled() and (x2.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _LinearFn.apply(x2, weight, bias, op)
    return op(x2, weight, bias)
