import torch
from torch import nn

from ssd.kernels.linear_cpu import linear
from ssd.kernels.linear_int8_cpu import linear_int8, quantize


class Linear(nn.Linear):
    """``nn.Linear`` whose forward, for fp32 tensors on the CPU, runs the batch-invariant
    kernel (row m of the output does not depend on the other rows, so scoring K+1 tokens
    gives the bits of scoring each alone); anything else (CUDA, bf16) goes to ``F.linear``.

    After :meth:`quantize_int8` it holds int8 weights instead (for a draft model) and runs
    the batch-invariant int8 kernel, or stock torch ops on the dequantized weights."""

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
