"""The paged KV cache: one tensor for all layers, cut into fixed-size blocks.

A sequence owns a list of blocks (its block table); token position p lives in slot
block_table[p // block_size] * block_size + p % block_size. The cache also keeps how many
leading positions of each owner hold K/V (`cached`): a forward pass writes them
(ModelRunner), and rolling back rejected tokens is only a length change: `truncate` frees
whole blocks past the new length and the stale slots inside the last block are overwritten
by the next write.

With prefix caching (prefix_cache.py), full blocks of confirmed tokens are named
(`commit`), a new owner starts from the longest run of named blocks its tokens begin with
(`match`), and blocks are reference-counted: shared blocks are read-only, and a write into
one (`writable`) copies it first, so neither rollback nor speculation changes a block that
another sequence or the cache still reads.
"""
import numpy as np
import torch

from ssd.models.config import ModelConfig
from ssd.runner.prefix_cache import PrefixCache


class CacheFullError(RuntimeError):
    pass


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_tokens: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, prefix_salt: str | None = None):
        """prefix_salt: turns prefix caching on; what else than tokens sets a block's K/V
        (the model, its dtype and weights)."""
        self.block_size = block_size
        self.num_blocks = -(-num_tokens // block_size)
        # torch.empty: pages of memory are committed only when first written.
        self.kv = torch.empty(cfg.num_layers, 2, self.num_blocks * block_size, cfg.num_kv_heads,
                              cfg.head_dim, device=device, dtype=dtype)
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.refs = [0] * self.num_blocks  # owners holding each block
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # owner -> leading positions whose K/V are written
        self.prefix = None if prefix_salt is None else PrefixCache(block_size, prefix_salt)
        self.names: dict[int, list[bytes]] = {}  # owner -> names of its leading full blocks
        self.tenants: dict[int, str] = {}  # owner -> its cache_salt, where it has one
        self._scratch: int | None = None

    def cached(self, owner: int) -> int:
        """Leading positions of `owner` whose K/V are in the cache."""
        return self.lengths.get(owner, 0)

    def written(self, owner: int, end: int) -> None:
        """A forward pass wrote `owner`'s K/V up to position end - 1 (ModelRunner)."""
        self.lengths[owner] = end

    @property
    def available(self) -> int:
        """Blocks a reservation can take: free ones, and cached ones no owner holds."""
        return len(self.free_blocks) + (len(self.prefix.unused) if self.prefix else 0)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.available

    @property
    def cached_blocks(self) -> int:
        """Named blocks (prefix caching), held or not."""
        return len(self.prefix.name_of) if self.prefix else 0

    def blocks_needed(self, owner: int, num_tokens: int) -> int:
        have = len(self.tables.get(owner, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_reserve(self, owner: int, num_tokens: int) -> bool:
        return self.blocks_needed(owner, num_tokens) <= self.available

    def reserve(self, owner: int, num_tokens: int) -> None:
        """Make sure `owner` has slots for positions 0..num_tokens-1."""
        need = self.blocks_needed(owner, num_tokens)
        if need > self.available:
            raise CacheFullError(f"KV cache full: need {need} blocks, {self.available} free")
        table = self.tables.setdefault(owner, [])
        table.extend(self._take() for _ in range(need))

    def truncate(self, owner: int, num_tokens: int) -> None:
        """Keep only positions < num_tokens (rollback); frees the blocks past them."""
        table = self.tables.get(owner, [])
        if owner in self.lengths:
            self.lengths[owner] = min(self.lengths[owner], num_tokens)
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self._drop(table.pop())
        if owner in self.names:
            del self.names[owner][num_tokens // self.block_size:]

    def release(self, owner: int) -> None:
        for block in reversed(self.tables.pop(owner, [])):
            self._drop(block)
        self.lengths.pop(owner, None)
        self.names.pop(owner, None)
        self.tenants.pop(owner, None)

    def held(self) -> dict[str, int]:
        """Owners with blocks or written positions, and the blocks they hold."""
        return {"owners": len(self.tables.keys() | self.lengths.keys()), "blocks": self.blocks_in_use}

    def scratch_slot(self) -> int:
        """A slot no owner ever gets (its block is taken for good): the padding tokens of a
        captured step write their K/V there (cuda_graphs.py)."""
        if self._scratch is None:
            self._scratch = self._take() * self.block_size
        return self._scratch

    def slots(self, owner: int, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions start..end-1 of `owner` (a CPU LongTensor), to read."""
        return torch.from_numpy(self.slot_array(owner, end)[start:])

    def slot_array(self, owner: int, end: int) -> np.ndarray:
        """Cache slots of positions 0..end-1 of `owner`, as int64 numpy (the captured steps
        write them straight into their pinned inputs)."""
        bs = self.block_size
        table = np.asarray(self.tables[owner][:-(-end // bs)], dtype=np.int64)
        if len(table) * bs < end:
            raise IndexError(f"owner {owner} holds {len(table) * bs} slots, not {end}")
        return (table[:, None] * bs + np.arange(bs)).ravel()[:end]

    def copy_position(self, owner: int, src: int, dst: int) -> None:
        """Position src's K/V (every layer) into position dst's slot, both written by `owner`
        (a verify pass's sibling leaf taking its chain token's place, ssd/speculative/policy/siblings.py)."""
        self.prepare_write(owner, dst, dst + 1)
        slots = self.slot_array(owner, max(src, dst) + 1)
        self.kv[:, :, int(slots[dst])] = self.kv[:, :, int(slots[src])]

    def writable(self, owner: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions start..end-1 to write into (prepare_write)."""
        self.prepare_write(owner, start, end)
        return self.slots(owner, start, end)

    def prepare_write(self, owner: int, start: int, end: int) -> None:
        """Make positions start..end-1 writable: a block there that others hold is copied
        first (copy on write), and one only this owner holds loses its name."""
        table, bs = self.tables[owner], self.block_size
        for i in range(start // bs, -(-end // bs)):
            block = table[i]
            if self.refs[block] > 1:
                copy = self._take()
                self.kv[:, :, copy * bs:(copy + 1) * bs] = self.kv[:, :, block * bs:(block + 1) * bs]
                table[i] = copy
                self._drop(block)
            elif self.prefix:
                self.prefix.forget(block)
        if owner in self.names:
            del self.names[owner][start // bs:]

    # ---- prefix caching --------------------------------------------------------------------
    def match(self, owner: int, tokens: list[int], tenant: str | None = None, reuse: bool = True) -> int:
        """Start a new owner from the cached blocks its tokens begin with, among its tenant's
        (its request's cache_salt; prefix_cache.py); returns how many leading positions it got
        (whole blocks, and never the last token, whose logits the caller needs). reuse False:
        none (the caller needs every position's logits); its blocks are still named for its
        tenant."""
        if self.prefix is None or owner in self.tables:
            return self.cached(owner)
        if tenant is not None:
            self.tenants[owner] = tenant
        if not reuse:
            return 0
        names = self.prefix.names(tokens[:len(tokens) - 1], tenant=tenant)
        blocks = self.prefix.lookup(names)
        for block in blocks:
            if self.refs[block] == 0:
                del self.prefix.unused[block]
            self.refs[block] += 1
        if blocks:
            self.tables[owner], self.names[owner] = blocks, names[:len(blocks)]
            self.lengths[owner] = len(blocks) * self.block_size
        self.prefix.queries += len(tokens)
        self.prefix.hits += len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def first_block(self, tokens: list[int], tenant: str | None = None) -> bytes | None:
        """The name of the first full block of `tokens` for `tenant` (None: no prefix caching,
        or shorter than a block)."""
        if self.prefix is None or len(tokens) <= self.block_size:
            return None
        return self.prefix.names(tokens[:self.block_size], tenant=tenant)[0]

    def commit(self, owner: int, tokens: list[int]) -> None:
        """`tokens` are the owner's confirmed tokens: name its full blocks among them whose
        K/V are written, so later owners can start from them."""
        if self.prefix is None:
            return
        n = min(self.cached(owner), len(tokens)) // self.block_size
        known = self.names.setdefault(owner, [])
        if len(known) >= n:
            return
        names = self.prefix.names(tokens[:n * self.block_size], known, self.tenants.get(owner))
        table = self.tables[owner]
        for i in range(len(known), n):
            self.prefix.add(names[i], table[i])
        self.names[owner] = names

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:
            block = self.prefix.evict()
        self.refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.prefix is not None and block in self.prefix.name_of:
                self.prefix.unused[block] = None  # the most recently used
            else:
                self.free_blocks.append(block)
