"""The KV block pool: fixed-size blocks of KV-cache slots handed out to sequences (plain Python, no torch).

A sequence's block table maps its logical token positions to physical slots: position p lives in slot
``table[p // block_size] * block_size + p % block_size``. The model runner owns the tensors; this module only
accounts for which blocks are in use, so that admission can never promise more KV memory than exists.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking ``can_allocate`` first (a scheduler bug)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, owner: str) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._owner[b] = owner
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._owner.pop(b, None) is None:
                raise ValueError(f"block {b} freed twice or never allocated")
            self._free.append(b)

    def owners(self) -> set[str]:
        """Request ids holding blocks (for leak checks)."""
        return set(self._owner.values())


class BlockTable:
    """One sequence's list of physical blocks, grown on demand."""

    def __init__(self, pool: BlockPool, owner: str) -> None:
        self.pool = pool
        self.owner = owner
        self.blocks: list[int] = []

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

    def trim(self, num_tokens: int) -> None:
        """Give back the blocks past those that hold ``num_tokens`` tokens (speculative guesses rolled back)."""
        keep = self.pool.blocks_for(num_tokens)
        if len(self.blocks) > keep:
            self.pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def release(self) -> None:
        if self.blocks:
            self.pool.free(self.blocks)
            self.blocks = []

    def slot(self, position: int) -> int:
        size = self.pool.block_size
        return self.blocks[position // size] * size + position % size
