"""The KV block pool: fixed-size blocks of KV-cache slots handed out to sequences (plain Python, no torch).

A sequence's block table maps its logical token positions to physical slots: position p lives in slot
``table[p // block_size] * block_size + p % block_size``. The model runner owns the tensors; this module only
accounts for which blocks are in use, so that admission can never promise more KV memory than exists.

Prefix caching (prefix_cache.py hashes the tokens): a block that is full and computed may be registered under the hash
of its content (its tokens and every token before it). Blocks are reference-counted: a cached block can sit in several
tables at once, and it is only ever read there, because a sequence writes only positions past its computed tokens,
which lie in its own last, non-full blocks. A block whose last reference goes returns to the free list but keeps its
content and hash: a later request with the same prefix can take it back until it is handed out again. The free list is
in LRU order: blocks that hold nothing worth keeping are reused first, then cached ones, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking ``can_allocate`` first (a scheduler bug)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Unreferenced blocks; the head is handed out first (the eviction end).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._holders: dict[int, list[str]] = {}  # block -> request ids referencing it (its refcount is the length)
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self.num_evictions = 0  # cached blocks whose content was dropped to hand them out again
        # Blocks >= this were never handed out. The free list keeps them as one ascending run between the reused
        # blocks at its head and the cached ones at its tail, and hands them out in that order, so this is all it
        # takes to know them (the KV cache's pages of those blocks were never written: engine.warm_kv).
        self._fresh_from = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out, including unreferenced ones that still hold cached content."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._hash_of_block)

    @property
    def fresh_from(self) -> int:
        """The lowest block never handed out; every block from it on was never handed out either."""
        return self._fresh_from

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, owner: str) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._forget(block)  # its old content is about to be overwritten
            self._fresh_from = max(self._fresh_from, block + 1)
            self._holders[block] = [owner]
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int], owner: str | None = None) -> None:
        """Drop one reference per block (``owner``'s; without an owner the block must have a single holder)."""
        for b in blocks:
            holders = self._holders.get(b)
            if not holders:
                raise ValueError(f"block {b} freed twice or never allocated")
            if owner is None:
                if len(holders) > 1:
                    raise ValueError(f"block {b} is shared by {holders}: name the owner that frees it")
                holders.pop()
            elif owner in holders:
                holders.remove(owner)
            else:
                raise ValueError(f"block {b} is not held by {owner!r}")
            if not holders:
                del self._holders[b]
                self._free[b] = None  # the tail: most recently used, evicted last
                if b not in self._hash_of_block:
                    self._free.move_to_end(b, last=False)  # nothing worth keeping: handed out first

    def refcount(self, block: int) -> int:
        return len(self._holders.get(block, ()))

    def owners(self) -> set[str]:
        """Request ids holding blocks (for leak checks)."""
        return {owner for holders in self._holders.values() for owner in holders}

    # --- prefix cache -----------------------------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` (a sequence's leading full blocks) found in the cache."""
        found = []
        for h in hashes:
            block = self._block_of_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def num_unreferenced(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free list (taking a reference to them uses up free capacity)."""
        return sum(b in self._free for b in blocks)

    def share(self, blocks: Iterable[int], owner: str) -> None:
        """Take a reference to cached blocks for ``owner`` (out of the free list if nobody held them)."""
        for b in blocks:
            if b not in self._hash_of_block:
                raise ValueError(f"block {b} holds no cached content; only cached blocks can be shared")
            if b in self._free:
                del self._free[b]
            holders = self._holders.setdefault(b, [])
            if owner in holders:
                raise ValueError(f"block {b} is already held by {owner!r}")
            holders.append(owner)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable by its hash. False when that content is already cached in another
        block (two requests computed the same prefix at once): this one stays private and is reused first when freed."""
        if block not in self._holders:
            raise ValueError(f"block {block} is not allocated; only a held, computed block can be registered")
        if block_hash in self._block_of_hash or block in self._hash_of_block:
            return False
        self._block_of_hash[block_hash] = block
        self._hash_of_block[block] = block_hash
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of_block

    def reset_cache(self) -> int:
        """Forget all cached content that nobody references (returns how many blocks were dropped)."""
        dropped = [b for b in self._free if b in self._hash_of_block]
        for b in dropped:
            self._forget(b)
            self._free.move_to_end(b, last=False)
        return len(dropped)

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self.num_evictions += 1


class BlockTable:
    """One sequence's list of physical blocks, grown on demand. Its first ``num_cached`` blocks are full and computed:
    never written again, registered in the prefix cache (unless that content was already cached in another block) and
    possibly shared with other tables."""

    def __init__(self, pool: BlockPool, owner: str) -> None:
        self.pool = pool
        self.owner = owner
        self.blocks: list[int] = []
        self.num_cached = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return max(0, self.pool.blocks_for(num_tokens) - len(self.blocks))

    def ensure(self, num_tokens: int) -> bool:
        """Grow to hold ``num_tokens`` tokens; False (and nothing allocated) when the pool is short."""
        need = self.blocks_needed(num_tokens)
        if need == 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        self.blocks.extend(self.pool.allocate(need, self.owner))
        return True

    def attach_cached(self, blocks: list[int]) -> None:
        """Start an empty table with cached blocks found for its leading tokens (a prefix cache hit)."""
        if self.blocks:
            raise ValueError("cached blocks can only start an empty block table")
        self.pool.share(blocks, self.owner)
        self.blocks = list(blocks)
        self.num_cached = len(blocks)

    def trim(self, num_tokens: int) -> None:
        """Give back the blocks past those that hold ``num_tokens`` tokens (speculative guesses rolled back)."""
        keep = self.pool.blocks_for(num_tokens)
        if keep < self.num_cached:
            raise ValueError(f"trimming to {num_tokens} tokens would drop cached (full, computed) blocks")
        if len(self.blocks) > keep:
            self.pool.free(reversed(self.blocks[keep:]), self.owner)
            del self.blocks[keep:]

    def release(self) -> None:
        if self.blocks:
            # Last block first: the free list's LRU order then evicts a conversation's tail before its shared head.
            self.pool.free(reversed(self.blocks), self.owner)
            self.blocks = []
        self.num_cached = 0

    def slot(self, position: int) -> int:
        size = self.pool.block_size
        return self.blocks[position // size] * size + position % size
