"""The CPU kernels' outputs on fixed inputs, for comparing builds across machines: every build
of every architecture must give these bits (docs/kernels.md, "Accumulation order"). The inputs
come from numpy's generator, whose streams are the same on every platform (torch's random
fills are vectorised per CPU and need not be)."""
import numpy as np
import torch

from ssd.kernels import attention_cpu, fused_cpu, linear_cpu, linear_int8_cpu
from ssd.kernels import quant_cpu as Q

TYPES = sorted(Q.SUPPORTED, key=int)


def normal(seed: int, *shape: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def outputs(variant: str) -> dict[str, torch.Tensor]:
    """Each kernel of one build on the same inputs: the GGUF product for every type at 1 and 9
    rows, the fp32 / fp16 / bf16 and int8 products, attention with and without soft-capping,
    and RMSNorm."""
    from test_quant_kernel import blocks  # random GGUF blocks from numpy's generator
    out = {}
    x = normal(0, 9, 512)
    for qtype in TYPES:
        part = Q.repack(blocks(qtype, 40, 512, seed=3), qtype, 40, 512, variant=variant)
        out[f"qlinear {qtype.name}"] = Q.qlinear(x, [part], variant=variant)
        out[f"qlinear {qtype.name} row"] = Q.qlinear(x[:1], [part], variant=variant)
    x, w, bias = normal(1, 5, 96), normal(2, 33, 96), normal(3, 33)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out[f"linear {dtype}"] = linear_cpu.linear(x, w.to(dtype), bias, variant=variant)
    qweight, scale = linear_int8_cpu.quantize(w)
    out["linear_int8"] = linear_int8_cpu.linear_int8(x, qweight, scale, bias, variant=variant)
    q, k, v = normal(4, 3, 4, 32), normal(5, 40, 2, 32), normal(6, 40, 2, 32)
    rows = torch.from_numpy(np.random.default_rng(7).permutation(40).reshape(2, 20).astype(np.int64))
    q_row, q_len = torch.tensor([0, 1, 1]), torch.tensor([7, 19, 20])
    for cap in (None, 30.0):
        out[f"attention softcap {cap}"] = attention_cpu.attention(q, k, v, rows, q_row, q_len, 32 ** -0.5, cap,
                                                                  variant=variant)
    out["rms_norm"] = fused_cpu.get_op("rms_norm", variant)(x, normal(8, 96), 1e-6)
    return out
