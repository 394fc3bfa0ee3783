import torch
from torch import nn

from ssd.kernels.linear_cpu import linear
from ssd.kernels.linear_int8_cpu import linear_int8, quantize
from ssd.kernels.quant_cpu import QuantMatrix, QuantStack, dequant_rows


class Linear(nn.Linear):
    """``nn.Linear`` whose forward, for fp32 tensors on the CPU, is batch-invariant (row m of
    the output does not depend on the other rows, so scoring K+1 tokens gives the bits of
    scoring each alone): the kernel, or where it cannot be built ``F.linear`` on each row
    alone; anything else (CUDA, bf16) goes to ``F.linear``.

    After :meth:`quantize_int8` it holds int8 weights instead (for a draft model) and runs
    the batch-invariant int8 kernel, or stock torch ops on the dequantized weights (each row
    alone on the CPU)."""

    @property
    def quantized(self) -> bool:
        return "qweight" in self._buffers

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Replace the weight by int8 ``qweight`` [out, in] and fp32 ``weight_scale`` [out]
        buffers (symmetric, per output row). Only this module drops its reference to the
        fp32 weight: a tied input embedding keeps its fp32 table and its exact lookups."""
        if self.quantized:
            return
        qweight, scale = quantize(self.weight)
        del self.weight
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return linear_int8(x, self.qweight, self.weight_scale, self.bias)
        return linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """A linear layer on GGUF-quantised weights (ssd/kernels/quant_cpu.py): the output is the
    parts' rows stacked (q, k and v of one attention, say, each of its own GGUF type), and
    the batch-invariant kernel computes them all in one call, from one quantisation of x."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = parts
        self.stack = QuantStack(parts)
        self.in_features, self.out_features = self.stack.cols, self.stack.rows
        for i, p in enumerate(parts):  # buffers, so that the module's memory is visible to torch
            self.register_buffer(f"packed{i}", p.packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32:
            return self.stack(x, self.bias)
        return self.stack(x.float(), self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        types = "+".join(p.qtype.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


class QuantEmbedding(nn.Module):
    """Token embeddings looked up in a GGUF tensor's own blocks: each looked-up row is
    dequantised exactly as the gguf package does (the values of the fp32 copy)."""

    def __init__(self, raw: torch.Tensor, qtype, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, num_embeddings, embedding_dim
        self.register_buffer("raw", raw, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequant_rows(self.raw, self.qtype, ids, self.embedding_dim).view(*ids.shape, self.embedding_dim)
