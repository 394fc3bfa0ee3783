"""A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks each token's top-k
experts, each a gated MLP, and the token's output is their outputs weighted by the router.

Why this shape: a verify pass of K+1 rows touches the union of their experts. Each expert hit
in a call runs once, on all the rows routed to it (its weights are read once per call), with
the batch-invariant linear kernels; a row's output is then the sum of its experts' weighted
outputs added in ascending expert order. Every step of a row depends on that row alone (its
router scores, its top-k, its experts' rows), never on which other rows share the call or which
experts they chose, so speculation stays exact (tests/test_moe.py).
"""
import math

import torch
from torch import nn

from ssd.kernels import decoder_cpu
from ssd.kernels.linear_cpu import linear
from ssd.kernels.quant_cpu import QuantMatrix, QuantStack
from ssd.layers.linear import Linear
from ssd.layers.mlp import ACTIVATION_IDS, ACTIVATIONS


class DenseExperts(nn.Module):
    """Every expert's weights stacked in the compute dtype: gate_up_proj [E, 2I, H] (each
    expert's gate rows, then its up rows), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.gate_up_proj[e])

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.down_proj[e])


class QuantExperts(nn.Module):
    """Every expert's matrices on the GGUF file's own blocks (ssd/kernels/quant_cpu.py): the
    file stacks each kind of matrix for all experts in one tensor (ffn_gate_exps, ...); each
    expert's slice is repacked alone."""

    def __init__(self, gate: list[QuantMatrix], up: list[QuantMatrix], down: list[QuantMatrix]):
        super().__init__()
        self.gate_ups = [QuantStack([g, u]) for g, u in zip(gate, up)]
        self.downs = [QuantStack([d]) for d in down]
        self.intermediate = gate[0].rows
        self.op_args = ([p for s in self.gate_ups for p in s.packed], [t for s in self.gate_ups for t in s.types],
                         [s.packed[0] for s in self.downs], [s.types[0] for s in self.downs])
        for i, m in enumerate(p for mats in (gate, up, down) for p in mats):  # visible to torch's memory count
            self.register_buffer(f"packed{i}", m.packed, persistent=False)

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_ups[e](x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.downs[e](x)

    def run(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, act: int) -> torch.Tensor | None:
        """SparseMoE.loop as one CPU op (csrc/decoder.cpp, experts): the Python loop's dozen calls
        an expert cost more than a small expert's product. None where the op cannot run here."""
        if not (x.is_cpu and x.dtype is torch.float32):
            return None
        return decoder_cpu.experts(x.contiguous(), weights, chosen, *self.op_args, self.intermediate, act)


class SparseMoE(nn.Module):
    """Router (softmax over experts in fp32, top-k, renormalised where the model does), the
    experts, and Qwen2-MoE's shared expert (a dense gated MLP scaled by a sigmoid gate)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool, act: str,
                 shared: nn.Module | None = None):
        super().__init__()
        self.top_k, self.normalize, self.act_name, self.act = top_k, normalize, act, ACTIVATIONS[act]
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts: DenseExperts | QuantExperts = DenseExperts(num_experts, hidden, intermediate)
        self.shared_expert = shared
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared is not None else None
        self.fused = True  # the experts' loop as one CPU op where it applies (QuantExperts.run)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) of each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            # The sum of k terms one at a time: torch's reduction would order them differently
            # for different row counts.
            total = weights[:, 0]
            for j in range(1, self.top_k):
                total = total + weights[:, j]
            weights = weights / total[:, None]
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = None
        if isinstance(self.experts, QuantExperts) and self.fused:
            out = self.experts.run(x, weights, chosen, ACTIVATION_IDS[self.act_name])
        if out is None:
            out = self.loop(x, weights, chosen)
        if self.shared_expert is not None:
            out = out + self.shared_scale(x) * self.shared_expert(x)
        return out

    def loop(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The experts hit, in ascending order, each on all its rows (QuantExperts.run: the same in C++)."""
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            tokens, rank = (chosen == e).nonzero(as_tuple=True)
            gate, up = self.experts.gate_up(e, x[tokens]).chunk(2, dim=-1)
            y = self.experts.down(e, self.act(gate) * up)
            out.index_add_(0, tokens, y * weights[tokens, rank, None])
        return out

    def shared_scale(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(shared_expert_gate(x)) [T, 1], one value at a time in float64: torch's sigmoid
        over a column of T values rounds the vectorised part and the tail differently, so a
        token's value would change with T."""
        g = self.shared_expert_gate(x)
        return torch.tensor([[0.5 * (1.0 + math.tanh(0.5 * v))] for v in g[:, 0].tolist()], dtype=x.dtype, device=x.device)
