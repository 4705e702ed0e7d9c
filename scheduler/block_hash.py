"""Content hashes of full KV blocks, chained so that a block's hash names its whole prefix."""

from __future__ import annotations

import array
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request


def root_hash(cache_key: bytes, cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: the model/adapter key and the request's salt, so
    that different models, adapters or tenants never share blocks."""
    digest = hashlib.blake2b(cache_key, digest_size=16)
    if cache_salt is not None:
        digest.update(b"\x00salt\x00" + cache_salt.encode())
    return digest.digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array.array("q", token_ids).tobytes())
    return digest.digest()


def block_hashes(request: "Request", block_size: int, num_blocks: int,
                 cache_key: bytes) -> list[bytes]:
    """The chained hashes of request's first num_blocks full blocks, memoised on the request."""
    hashes = request.block_hashes
    if len(hashes) < num_blocks:
        parent = hashes[-1] if hashes else root_hash(cache_key, request.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, request.token_ids_slice(i * block_size,
                                                                (i + 1) * block_size))
            hashes.append(parent)
    return hashes[:num_blocks]
