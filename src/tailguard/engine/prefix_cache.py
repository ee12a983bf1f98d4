"""Content hashes of KV blocks for prefix caching (plain Python, no torch).

A full block's hash chains its parent's hash and its own token ids, so equal hashes mean equal tokens in that block
*and* in every block before it: the KV there is the same (the model is causal), and a request whose leading blocks
hash the same as cached ones can take those blocks instead of recomputing them. SHA-256 makes an accidental collision
(which would silently serve the wrong KV) practically impossible; hashing a block costs about a microsecond.
"""

from __future__ import annotations

import hashlib
from array import array

from tailguard.engine.sequence import Sequence

ROOT_HASH = b"tailguard-prefix-cache-v1"


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The chained hash of one full block of token ids, given the hash of the block before it (ROOT_HASH first)."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int, known: list[bytes] | None = None) -> list[bytes]:
    """The hashes of the first ``num_blocks`` full blocks of ``token_ids``; ``known`` (extended in place, then
    returned) holds hashes already computed for a prefix of them."""
    hashes = known if known is not None else []
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need more than {len(token_ids)} tokens")
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


def sequence_block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """A sequence's leading full-block hashes, computed once (its tokens never change, they only grow)."""
    if len(seq.block_hashes) >= num_blocks:
        return seq.block_hashes[:num_blocks]
    tokens = seq.token_ids_slice(0, num_blocks * block_size)
    return block_hashes(tokens, block_size, num_blocks, seq.block_hashes)[:num_blocks]


def cacheable_prefix_blocks(num_tokens: int, block_size: int) -> int:
    """Most leading blocks a request may take from the cache: full blocks that leave at least its last token to be
    computed, because sampling needs that position's logits (and a shared block must never be written)."""
    return max(0, num_tokens - 1) // block_size
