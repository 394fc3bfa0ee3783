"""The paged KV cache: one tensor for all layers, cut into fixed-size blocks.

A sequence owns a list of blocks (its block table); token position p lives in slot
block_table[p // block_size] * block_size + p % block_size. The cache also keeps how many
leading positions of each owner hold K/V (`cached`): a forward pass writes them
(ModelRunner), and rolling back rejected tokens is only a length change: `truncate` frees
whole blocks past the new length and the stale slots inside the last block are overwritten
by the next write.
"""
import torch

from ssd.models.config import ModelConfig


class CacheFullError(RuntimeError):
    pass


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_tokens: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.block_size = block_size
        self.num_blocks = -(-num_tokens // block_size)
        # torch.empty: pages of memory are committed only when first written.
        self.kv = torch.empty(cfg.num_layers, 2, self.num_blocks * block_size, cfg.num_kv_heads,
                              cfg.head_dim, device=device, dtype=dtype)
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # owner -> leading positions whose K/V are written

    def cached(self, owner: int) -> int:
        """Leading positions of `owner` whose K/V are in the cache."""
        return self.lengths.get(owner, 0)

    def written(self, owner: int, end: int) -> None:
        """A forward pass wrote `owner`'s K/V up to position end - 1 (ModelRunner)."""
        self.lengths[owner] = end

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, owner: int, num_tokens: int) -> int:
        have = len(self.tables.get(owner, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_reserve(self, owner: int, num_tokens: int) -> bool:
        return self.blocks_needed(owner, num_tokens) <= len(self.free_blocks)

    def reserve(self, owner: int, num_tokens: int) -> None:
        """Make sure `owner` has slots for positions 0..num_tokens-1."""
        need = self.blocks_needed(owner, num_tokens)
        if need > len(self.free_blocks):
            raise CacheFullError(f"KV cache full: need {need} blocks, {len(self.free_blocks)} free")
        table = self.tables.setdefault(owner, [])
        table.extend(self.free_blocks.pop() for _ in range(need))

    def truncate(self, owner: int, num_tokens: int) -> None:
        """Keep only positions < num_tokens (rollback); frees the blocks past them."""
        table = self.tables.get(owner, [])
        if owner in self.lengths:
            self.lengths[owner] = min(self.lengths[owner], num_tokens)
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self.free_blocks.append(table.pop())

    def release(self, owner: int) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(owner, [])))
        self.lengths.pop(owner, None)

    def held(self) -> dict[str, int]:
        """Owners with blocks or written positions, and the blocks they hold."""
        return {"owners": len(self.tables.keys() | self.lengths.keys()), "blocks": self.blocks_in_use}

    def slots(self, owner: int, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions start..end-1 of `owner` (a CPU LongTensor)."""
        table = torch.tensor(self.tables[owner], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
