"""Fused CUDA steps of a decoder layer, in Triton: RMSNorm (with the residual add before it),
RoPE with the KV-cache write, and the gated activation. The GPU twin of fused_cpu.py.

Why: in eager PyTorch these three steps are about 35 small kernels a layer (RMSNorm's upcast,
square, mean, rsqrt, products and downcast; RoPE's gathers, negation, concatenation, products
and sums for q and k; the two cache copies; the activation and its product). A captured step
still pays a few microseconds of launch for each, most of a small model's decode step
(docs/kernels.md, "GPU"). Here each step is one kernel.

Each program computes one row (a token, or a token's head) in a fixed order, whatever the other
rows, so the results are batch-invariant. Arithmetic is fp32, rounded once to the tensor's
dtype: not the bits of the torch expressions they replace (which round in bf16 between
steps), so every CUDA pass uses them, eager or captured alike.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without triton: the callers keep torch
    triton = None


def available(x: torch.Tensor) -> bool:
    """Whether the layers use these kernels for x: on CUDA, with triton installed."""
    return triton is not None and x.is_cuda


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        live = i < n
        x = tl.load(x_ptr + row * n + i, mask=live, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + i, (x * inv * w).to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
        """sum = x + h rounded to the dtype (torch's add), y = RMSNorm(sum): one pass, no add kernel."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        live = i < n
        s = tl.load(x_ptr + row * n + i, mask=live, other=0.0).to(tl.float32) + \
            tl.load(h_ptr + row * n + i, mask=live, other=0.0).to(tl.float32)
        s = s.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n + i, s, mask=live)
        x = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + i, (x * inv * w).to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr,
                           cos_ptr, sin_ptr, q_stride, k_stride, v_stride, HEADS: tl.constexpr,
                           KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, D_P: tl.constexpr):
        """One program per token and head (q heads, then kv heads): rotate-half RoPE over the
        first ROT dims; a kv head also writes its k and v into the cache at the token's slot.
        q, k and v are read at their tokens' strides (views of one qkv projection: no copies)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D_P)
        live = d < D
        half = ROT // 2
        rot = d < ROT
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        p = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + p * ROT + d, mask=rot, other=1.0)
        sin = tl.load(sin_ptr + p * ROT + d, mask=rot, other=0.0)
        if h < HEADS:
            src = q_ptr + t * q_stride + h * D
            x = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
            xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
            y = tl.where(rot, x * cos + sign * xp * sin, x)
            tl.store(q_out_ptr + (t * HEADS + h) * D + d, y.to(q_out_ptr.dtype.element_ty), mask=live)
        else:
            g = h - HEADS
            src = k_ptr + t * k_stride + g * D
            x = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
            xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
            y = tl.where(rot, x * cos + sign * xp * sin, x)
            slot = tl.load(slot_ptr + t).to(tl.int64)
            tl.store(k_cache_ptr + (slot * KV_HEADS + g) * D + d, y.to(k_cache_ptr.dtype.element_ty), mask=live)
            v = tl.load(v_ptr + t * v_stride + g * D + d, mask=live, other=0.0)
            tl.store(v_cache_ptr + (slot * KV_HEADS + g) * D + d, v.to(v_cache_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _act_mul_kernel(x_ptr, y_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        """y[row] = act(x[row, :n]) * x[row, n:] (gate and up fused in one matrix)."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        gate = tl.load(x_ptr + row * 2 * n + i, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n + n + i, mask=live, other=0.0).to(tl.float32)
        if GELU:  # tanh approximation; tanh(u) = 1 - 2 / (exp(2u) + 1)
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        tl.store(y_ptr + row * n + i, (act * up).to(y_ptr.dtype.element_ty), mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, RMSNorm(x + h)) in one kernel."""
    n = x.shape[-1]
    x2, h2 = x.reshape(-1, n).contiguous(), h.reshape(-1, n).contiguous()
    total, y = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](x2, h2, weight, total, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return total.view(x.shape), y.view(x.shape)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [T, heads, D] with contiguous heads (a view of a wider row, say), and its row stride."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x, x.stride(0)


def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [T, heads, D] rotated by its positions (returned); k rotated and v written into the
    cache [slots, kv_heads, D] at `slots`. cos/sin [positions, ROT] (ROT <= D: partial rotary)."""
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    (q, qs), (k, ks), (v, vs) = _rows(q), _rows(k), _rows(v)
    if t:
        _rope_cache_kernel[(t, heads + kv_heads)](
            q, k, v, out, k_cache, v_cache, positions, slots, cos, sin, qs, ks, vs, HEADS=heads, KV_HEADS=kv_heads,
            D=dim, ROT=cos.shape[-1], D_P=triton.next_power_of_2(dim))
    return out


def act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n).contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        _act_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, y, n, GELU=gelu, BLOCK=block)
    return y.view(*gate_up.shape[:-1], n)
