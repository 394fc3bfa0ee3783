"""An EAGLE-3 head's passes as CUDA graphs (ssd/runner/cuda_graphs.py), for FeatureHead on a
GPU: eagerly, one decoder layer launches a few dozen kernels from Python and the GPU waits on
the host between them (docs/kernels.md, "GPU"). Its greedy chains' steps after the first run
as one graph (ssd/runner/chain_graphs.py).
"""
import torch
from torch import nn

from ssd.layers.attention import AttentionBatch
from ssd.speculative.draft.eagle import EagleHead


class HeadPasses(nn.Module):
    """The head as CapturedSteps runs a model: the states a pass reads come from one of two
    static buffers, filled before each launch, the target's joined states (a first pass,
    CapturedSteps' `head` flag True) or the head's own output states (a draft step, False);
    the logits and output states leave as one tensor [T, Vd + H]."""

    def __init__(self, head: EagleHead, rows: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        cfg = head.config
        self.head = head
        self.target = torch.zeros(rows, 3 * cfg.target_hidden_size, device=device, dtype=dtype)
        self.own = torch.zeros(rows, cfg.hidden_size, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor,
                logits_index: torch.Tensor | None, first: bool, taps: tuple[int, ...] = ()) -> torch.Tensor:
        logits, out = self.head(tokens, (self.target if first else self.own)[:len(tokens)], positions, batch, kv)
        both = torch.cat([logits, out], dim=-1)
        return both if logits_index is None else both[logits_index]
