"""Batch invariance in plain PyTorch, for a CPU where the C++ kernels cannot run (no C++
compiler, ``SSD_CPU_KERNELS=off``).

Exact speculative decoding needs a row's result to have the same bits whether it is computed
alone (decode), among the K+1 rows of a verification or next to other sequences. Stock torch
ops do not promise that: a matmul or a reduction picks its blocking, its vector code and its
thread split by the shape of the whole call. So the fallbacks compute each row through calls
whose shapes depend on that row alone: slower (a Python loop over rows), but SD and SSD still
equal AR. Their bits differ from the kernels': an op takes one path or the other for every
call of a run (build.py decides once).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def rows_apart(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """f(x) for x [M, K] computed as f of each row alone: [1, K], a fresh copy, so that its
    shape and its memory alignment are the same whichever row it is and whatever M is."""
    if x.shape[0] == 0:
        return f(x)
    return torch.cat([f(x[i:i + 1].clone()) for i in range(x.shape[0])])
