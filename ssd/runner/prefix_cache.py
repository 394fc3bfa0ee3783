"""Which full KV blocks hold which tokens, so that a sequence whose prompt starts like an
earlier one maps those blocks instead of computing them again (the paged cache,
kv_cache.py, holds the blocks and their reference counts; this holds their names).

A full block is named by a hash of its tokens and of the name of the block before it, the
first block's by the cache's salt (the model, its dtype and weights: what else changes a
block's K/V) and the request's tenant (its cache_salt: requests of different tenants never
share a block, so a fast first token tells no caller that another's text is cached). The
same name means the same tokens at the same positions after the same
prefix, hence the same K/V bits: the kernels compute each position's K/V alone, whatever
chunk of a prompt it came in. A named block no sequence holds stays until its slot is
needed, and then the least recently used goes first.
"""
import hashlib
from array import array
from collections import OrderedDict


class PrefixCache:
    def __init__(self, block_size: int, salt: str):
        self.block_size = block_size
        self.salt = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self.block_of: dict[bytes, int] = {}  # name -> block
        self.name_of: dict[int, bytes] = {}  # block -> name
        self.unused: OrderedDict[int, None] = OrderedDict()  # named blocks no owner holds, oldest first
        self.queries = self.hits = 0  # tokens asked for and found, since start

    def root(self, tenant: str | None) -> bytes:
        """What the first block's name starts from: the cache's salt, and the tenant's."""
        if tenant is None:
            return self.salt
        return hashlib.blake2b(self.salt + b"\0" + tenant.encode(), digest_size=16).digest()

    def names(self, tokens: list[int], known: list[bytes] = (), tenant: str | None = None) -> list[bytes]:
        """The names of the full blocks of `tokens` for `tenant`; `known` are those of its
        first blocks."""
        bs, out = self.block_size, list(known)
        for i in range(len(out), len(tokens) // bs):
            h = hashlib.blake2b(out[-1] if out else self.root(tenant), digest_size=16)
            h.update(array("q", tokens[i * bs:(i + 1) * bs]).tobytes())
            out.append(h.digest())
        return out

    def lookup(self, names: list[bytes]) -> list[int]:
        """The blocks of the longest run of leading names that are cached."""
        blocks = []
        for name in names:
            block = self.block_of.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def add(self, name: bytes, block: int) -> None:
        """Name a block that now holds a full block's K/V (unless the name has a block)."""
        if name not in self.block_of and block not in self.name_of:
            self.block_of[name], self.name_of[block] = block, name

    def forget(self, block: int) -> None:
        """The block's content is about to change, or its slot goes to other tokens."""
        name = self.name_of.pop(block, None)
        if name is not None:
            del self.block_of[name]
        self.unused.pop(block, None)

    def evict(self) -> int:
        """The least recently used named block no owner holds, forgotten."""
        block = next(iter(self.unused))
        self.forget(block)
        return block
