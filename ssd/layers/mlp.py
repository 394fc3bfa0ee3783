"""The gated MLP of a decoder layer (SwiGLU, or GeGLU for Gemma)."""
import torch
import torch.nn.functional as F
from torch import nn

from ssd.kernels import fused_triton
from ssd.layers.linear import Linear

# By config name; the ids are what the one-op CPU paths take (csrc/decoder.cpp).
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1}


class MLP(nn.Module):
    """The gate and up projections fused into one matrix: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act, self.gelu = ACTIVATIONS[act], act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_triton.available(x):
            return self.down_proj(fused_triton.act_mul(self.gate_up_proj(x), self.gelu))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
