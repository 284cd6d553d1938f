"""Prefix-cache block identities: a cryptographic hash of a block's tokens chained with its parent's.

vLLM moved from Python's `hash()` to sha256 after CVE-2025-25183: with a 64-bit
non-cryptographic hash, a crafted prompt can collide with another's prefix and
read its cached KV. The algorithms are vLLM's (`--prefix-caching-hash-algo`):
`sha256` (default) hashes the token ids' bytes; `sha256_cbor` hashes a
canonical CBOR encoding (stable across languages and versions); `xxhash` and
`xxhash_cbor` (xxh3-128) are faster and not cryptographic: only for users who
trust every prompt. The block manager also checks a hit's tokens and parent,
so even a collision cannot share KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Hashable, Sequence

import cbor2
import xxhash

from engine.config import HASH_ALGOS

NAMESPACE_PREFIX = b"trio-llm/prefix-cache/v1\0"

BlockHash = bytes


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def _cbor(parent: bytes, tokens: Sequence[int]) -> bytes:
    return cbor2.dumps([parent, list(tokens)], canonical=True)


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxhash": lambda data: xxhash.xxh3_128_digest(data),
}


class PrefixHasher:
    """Chained block hashes under one algorithm and one namespace (the model)."""

    def __init__(self, algo: str = "sha256", namespace: bytes = b"") -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}")
        self.algo = algo
        self._digest = _DIGESTS[algo.removesuffix("_cbor")]
        self._encode = _cbor if algo.endswith("_cbor") else (lambda parent, tokens: parent + _token_bytes(tokens))
        self.root = self._digest(NAMESPACE_PREFIX + namespace)

    def block(self, parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
        """The identity of a full block: its tokens and everything before them."""
        return self._digest(self._encode(parent, tokens))

    def request_root(self, cache_key: Hashable | None) -> BlockHash:
        """The parent of a request's first block: the model's namespace, narrowed by the request's
        cache key (its prompt embeddings, its `cache_salt`), so different keys never share."""
        if cache_key is None:
            return self.root
        return self._digest(self.root + repr(cache_key).encode())
