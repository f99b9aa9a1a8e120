"""Chained block hashes: how a KV block of a token sequence is named.

``h_i = H(h_{i-1}, tokens of block i)`` with blake2b, so two sequences share
block ``i`` only when all tokens up to its end are equal, and the names are
stable across processes: a router hashes a prompt once and asks which
instance holds how long a prefix of it.

KV computed under a LoRA adapter differs from the base model's, so a request
with an adapter starts its chain from :func:`adapter_salt` instead of nothing:
its blocks never match another adapter's or the base's. The salt is the
adapter's name and content fingerprint, so an adapter unloaded at runtime and
replaced by another under the same name never reuses the old one's KV. The
router and the engine salt alike (the router learns fingerprints from the
instances); the pairing handshake checks that both sides of a pair hold the same
content under a name.

The first block's parent is salted once more by the request's prefix-cache
tenant (``SamplingParams.cache_salt``, see :func:`first_parent`): requests
share blocks only within a tenant, in the device pool and in every tier and
peer that names blocks by this chain, so no client learns from a hit that
another tenant sent the same tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: depends on every token up to its end."""
    return _chain(parent, array("q", token_ids).tobytes())


def adapter_salt(lora: str | None, fingerprint: str = "") -> bytes | None:
    """The parent of a request's first block: None for the base model, else the adapter's
    (its name and content fingerprint, ``pdserve.core.adapters.adapter_fingerprint``)."""
    if lora is None:
        return None
    key = b"pdserve-lora\0" + lora.encode() + b"\0" + fingerprint.encode()
    return hashlib.blake2b(key, digest_size=16).digest()


def first_parent(adapter: bytes | None, cache_salt: str | None) -> bytes | None:
    """The parent of a request's first block: its adapter's salt (:func:`adapter_salt`),
    chained with its prefix-cache tenant's ``cache_salt`` (None: the shared tenant)."""
    if cache_salt is None:
        return adapter
    return _chain(adapter, b"pdserve-cache-salt\0" + cache_salt.encode())


# A fresh hasher is a copy of this one: cheaper than parsing blake2b's arguments each
# block (a router hashes every prompt it places: 32 blocks for 512 tokens).
_BLAKE16 = hashlib.blake2b(digest_size=16)


def _chain(parent: bytes | None, block: bytes | memoryview) -> bytes:
    h = _BLAKE16.copy()
    if parent is not None:
        h.update(parent)
    h.update(block)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` from block ``start`` on.

    The same values as :func:`hash_block_tokens` block by block, with one byte
    conversion for the whole sequence (a router hashes every prompt it sees).
    """
    raw = memoryview(array("q", token_ids[start * block_size :]).tobytes())
    step = block_size * 8
    fresh = _BLAKE16.copy
    chained = parent or b""
    hashes = []
    for i in range(0, len(raw) // step * step, step):
        h = fresh()
        h.update(chained)  # no parent: b"", which changes nothing
        h.update(raw[i : i + step])
        chained = h.digest()
        hashes.append(chained)
    return hashes
