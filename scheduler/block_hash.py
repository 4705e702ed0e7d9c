"""Chained hashes: each whole piece of a sequence hashed with its parent's hash, so a piece's
hash names its whole prefix. The KV blocks' (here), a trace's prompt pieces (simulator) and the
router's prompt chunks (pagedjax.parallel.routing_policy) all chain this way."""

from __future__ import annotations

import array
import hashlib
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

if TYPE_CHECKING:
    from pagedjax.scheduler.request import Request


H = TypeVar("H")


def chained_hashes(items: Sequence, size: int, combine: Callable[[H, Sequence], H],
                   root: H) -> list[H]:
    """combine(parent, piece) over the whole size-long pieces of items, in order, each result
    the parent of the next (root that of the first); a partial last piece is left out."""
    hashes, parent = [], root
    for start in range(0, len(items) - size + 1, size):
        parent = combine(parent, items[start:start + size])
        hashes.append(parent)
    return hashes


def root_hash(cache_key: bytes, cache_salt: str | None, lora_key: str | None = None) -> bytes:
    """The parent of a sequence's first block: the model's key, the request's LoRA adapter's
    (name and version) and its salt, so that different models, adapters or tenants never
    share blocks."""
    digest = hashlib.blake2b(cache_key, digest_size=16)
    if lora_key is not None:
        digest.update(b"\x00lora\x00" + lora_key.encode())
    if cache_salt is not None:
        digest.update(b"\x00salt\x00" + cache_salt.encode())
    return digest.digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array.array("q", token_ids).tobytes())
    return digest.digest()


def token_block_hashes(token_ids: Sequence[int], block_size: int, cache_key: bytes,
                       cache_salt: str | None = None,
                       lora_key: str | None = None) -> list[bytes]:
    """The chained hashes of token_ids' full blocks, as block_hashes gives a request of them."""
    return chained_hashes(token_ids, block_size, lambda parent, piece: hash_block(
        parent, list(piece)), root_hash(cache_key, cache_salt, lora_key))


def block_hashes(request: "Request", block_size: int, num_blocks: int,
                 cache_key: bytes) -> list[bytes]:
    """The chained hashes of request's first num_blocks full blocks, memoised on the request."""
    hashes = request.block_hashes
    if len(hashes) < num_blocks:
        parent = hashes[-1] if hashes else root_hash(cache_key, request.cache_salt,
                                                     request.lora_key)
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, request.token_ids_slice(i * block_size,
                                                                (i + 1) * block_size))
            hashes.append(parent)
    return hashes[:num_blocks]
