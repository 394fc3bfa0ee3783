"""A decoder's layers in one CPU op (csrc/decoder.cpp), for a model on GGUF-block weights.

Why: a decode step of one token makes about a dozen kernel calls per layer, and from Python
each costs several microseconds of dispatch, argument checks and module calls besides its
work, per layer (docs/decision-log.md, "Per-layer overhead"). The op makes the same calls
from C++, in the same order, on the same kernels (quantised matmul, fused RMSNorm and RoPE,
attention; ATen's silu, mul and add), so its result has the bits of the Python loop, which
stays the path for everything else (other weights, CUDA, a kernel that could not be built).

`LayerStack.run` returns None where the op does not apply, and the caller loops in Python.
`experts` does the same for a mixture's experts (ssd/layers/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.kernels import attention_cpu, fused_cpu, linear_cpu, quant_cpu
from ssd.kernels.build import CppKernel

_KERNEL = CppKernel("decoder")


def _ns(kernel: CppKernel) -> str | None:
    variant = kernel.variant()
    return None if variant is None else kernel.op_namespace(variant)


@dataclass
class LayerStack:
    """Every layer's weights as the op takes them, built once per model (see decoder.cpp)."""

    norms: list[torch.Tensor]  # per layer: input norm, post-attention norm (Gemma: and pre-, post-MLP norms)
    parts: list[torch.Tensor]  # per layer: the packed parts of qkv, o, gate_up, down
    types: list[int]
    part_rows: list[int]
    nparts: list[int]
    qkv_bias: list[torch.Tensor]  # one per layer, or none
    qk_norms: list[torch.Tensor]  # per layer the q and k norms' weights (Qwen3), or none
    dims: list[int]  # num_heads, num_kv_heads, head_dim, intermediate_size, norms a layer, activation (1: gelu),
    #                   top-k, renormalise, an expert's intermediate size
    eps: float
    scale: float
    cos: torch.Tensor
    sin: torch.Tensor
    sliding: list[int]  # per layer 1 for a sliding-window layer
    window: int | None
    cos_w: torch.Tensor  # the sliding layers' RoPE
    sin_w: torch.Tensor
    softcap: float
    moe: list[int]  # per layer 1 where the MLP is a mixture of experts
    routers: list[torch.Tensor]  # per MoE layer, fp32 [experts, hidden]
    expert_gate_up: list[torch.Tensor]  # per MoE layer, per expert its gate and up parts
    expert_gate_up_types: list[int]
    expert_down: list[torch.Tensor]
    expert_down_types: list[int]

    def run(self, x: torch.Tensor, positions: torch.Tensor, batch, kv: torch.Tensor, taps: tuple[int, ...] = ()
            ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """x after every layer, the KV cache written, and the stream entering each layer of
        `taps` (ascending, L for the stream after the last); None where the op cannot run here.
        batch: the pass's AttentionBatch (ssd/layers/attention.py)."""
        if not (x.is_cpu and x.dtype is torch.float32 and kv.dtype is torch.float32):
            return None
        op = _KERNEL.op("layers")
        names = (_ns(quant_cpu._KERNEL), _ns(fused_cpu._KERNEL), _ns(attention_cpu._KERNEL), _ns(linear_cpu._KERNEL))
        if op is None or None in names:
            return None
        win = batch if self.window is None else batch.windowed(self.window)
        return op(x.contiguous(), positions, batch.slot_mapping, batch.rows, batch.q_row, batch.q_len, kv, self.cos,
                  self.sin, self.norms, self.parts, self.types, self.part_rows, self.nparts, self.qkv_bias,
                  self.qk_norms, self.dims, self.sliding, win.rows, win.q_row, win.q_len, self.cos_w, self.sin_w,
                  self.moe, self.routers, self.expert_gate_up, self.expert_gate_up_types, self.expert_down,
                  self.expert_down_types, self.eps, self.scale, self.softcap, list(taps), *names)


def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: list[torch.Tensor],
            gate_up_types: list[int], down: list[torch.Tensor], down_types: list[int], intermediate: int,
            act: int) -> torch.Tensor | None:
    """A mixture's experts on GGUF blocks as one op (see csrc/decoder.cpp); None where it cannot run."""
    op = _KERNEL.op("experts")
    quant = _ns(quant_cpu._KERNEL)
    if op is None or quant is None:
        return None
    return op(x, weights, chosen, gate_up, gate_up_types, down, down_types, intermediate, act, quant)
