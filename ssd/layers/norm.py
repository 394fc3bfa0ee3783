import torch
from torch import nn

from ssd.kernels import fused_cpu, fused_triton
from ssd.kernels.fallback import rows_apart


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_triton.available(x):
            return fused_triton.rms_norm(x, self.weight, self.eps)
        y = fused_cpu.rms_norm(x, self.weight, self.eps)
        if y is not None:
            return y
        if x.is_cpu and x.dtype is torch.float32:  # the kernel cannot run: each row alone, batch-invariant
            return rows_apart(self._norm, x.reshape(-1, x.shape[-1])).view_as(x)
        return self._norm(x)

    def add_forward(self, x: torch.Tensor, branch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + branch, this norm of it): a residual add and the norm after it, one kernel on
        CUDA (the same bits as the two steps); branch None: nothing to add."""
        if branch is None:
            return x, self(x)
        if fused_triton.available(x):
            return fused_triton.add_rms_norm(x, branch, self.weight, self.eps)
        x = x + branch
        return x, self(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
