"""Which part of each matrix a tensor-parallel rank holds (engine/tensor_parallel.py applies it
to a model in memory; models/loader.py reads only that part of a GGUF file's blocks)."""
from dataclasses import dataclass

import torch

from ssd.errors import UnsupportedModelError
from ssd.models.config import ModelConfig


def spans(n: int, world: int) -> list[tuple[int, int]]:
    """n items cut into `world` contiguous runs, the first n % world of them one longer."""
    size, extra = divmod(n, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + size + (r < extra))
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class Cut:
    """Rank `rank` of `world`: whole kv heads [kv_lo, kv_hi) with their query heads, the MLP's
    features [inter_lo, inter_hi), the vocabulary's rows [vocab_lo, vocab_hi)."""

    rank: int
    world: int
    kv_lo: int
    kv_hi: int
    per_kv: int  # query heads per kv head
    head_dim: int
    q_size: int  # the whole model's
    kv_size: int
    inter: int
    inter_lo: int
    inter_hi: int
    vocab_lo: int
    vocab_hi: int

    @property
    def q(self) -> tuple[int, int]:
        """This rank's query features (o_proj's input columns)."""
        return self.kv_lo * self.per_kv * self.head_dim, self.kv_hi * self.per_kv * self.head_dim

    def qkv_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows of q_proj, k_proj and v_proj."""
        q = torch.arange(*self.q)
        kv = torch.arange(self.kv_lo * self.head_dim, self.kv_hi * self.head_dim)
        return q, kv, kv

    def stacked_qkv_rows(self) -> torch.Tensor:
        """Its rows of one matrix stacking q, k and v."""
        q, k, v = self.qkv_rows()
        return torch.cat([q, self.q_size + k, self.q_size + self.kv_size + v])

    def gate_up_rows(self) -> torch.Tensor:
        """Its rows of one matrix stacking gate and up."""
        rows = torch.arange(self.inter_lo, self.inter_hi)
        return torch.cat([rows, self.inter + rows])


def plan(cfg: ModelConfig, rank: int, world: int, q_align: int = 1, inter_align: int = 1) -> Cut:
    """Rank `rank`'s cut of a model over `world` ranks. q_align / inter_align: the columns of
    o_proj / down_proj may be cut only at multiples of these (a GGUF type's block)."""
    if world > cfg.num_kv_heads:
        raise UnsupportedModelError(f"tensor parallelism over {world} ranks needs as many kv heads; "
                                    f"the model has {cfg.num_kv_heads}")
    if cfg.num_experts:
        raise UnsupportedModelError("tensor parallelism does not split mixtures of experts yet")
    kv_lo, kv_hi = spans(cfg.num_kv_heads, world)[rank]
    per_kv, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    if (kv_lo * per_kv * d) % q_align:
        raise UnsupportedModelError(f"tensor parallelism over {world} ranks would cut o_proj inside a block of "
                                    f"{q_align} values; load with weights='dequantized'")
    inter = cfg.intermediate_size
    if inter % inter_align:
        raise UnsupportedModelError(f"the MLP's {inter} features are no whole number of {inter_align}-value blocks; "
                                    "load with weights='dequantized'")
    lo, hi = spans(inter // inter_align, world)[rank]
    v_lo, v_hi = spans(cfg.vocab_size, world)[rank]
    return Cut(rank, world, kv_lo, kv_hi, per_kv, d, cfg.num_heads * d, cfg.num_kv_heads * d, inter,
               lo * inter_align, hi * inter_align, v_lo, v_hi)
