"""The disk KV tier's files: private to this user, and a block is used only if its MAC,
keyed by a secret of the rank that wrote it, holds."""

from __future__ import annotations

import hashlib
import os
import stat

import msgpack
import pytest
import torch

from pdserve.core.config import CacheConfig
from pdserve.core.step import TierLoad, TierOps, TierWrite
from pdserve.parallel.kv_tiers import _HEADER, TierStore

HASHES = [bytes([i]) * 16 for i in range(3)]


@pytest.fixture
def store(tmp_path):
    """A disk tier of three blocks holding three device blocks of random K and V."""
    cache = CacheConfig(disk_tier_bytes=1 << 20, disk_tier_path=str(tmp_path))
    kv = torch.randn(2, 2, 4, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
    old = os.umask(0o022)  # the usual umask: files would be 0644 by default
    try:
        tiers = TierStore(cache, host_slots=0, disk_slots=3, rank="tp0")
        writes = [TierWrite("save", i, 0, h) for i, h in enumerate(HASHES)]
        tiers.start(TierOps(writes=writes), kv)
        tiers.finish()
    finally:
        os.umask(old)
    yield tiers, kv
    tiers.close()


def _load(tiers: TierStore, kv: torch.Tensor) -> list[bool]:
    """Each block loaded back into device block 3 in turn; whether it loaded (one that
    loads must be the block that was saved)."""
    ok = []
    for h, source in zip(HASHES, range(3), strict=True):
        kv[:, :, 3] = 0
        loaded = tiers.start(TierOps(loads=[TierLoad("disk", 0, h, 3)]), kv)[0]
        assert not loaded or torch.equal(kv[:, :, 3], kv[:, :, source]), f"block {source}"
        ok.append(loaded)
    return ok


def test_disk_tier_files_are_private(store):
    tiers, _ = store
    assert stat.S_IMODE(tiers.folder.stat().st_mode) == 0o700
    files = sorted(tiers.folder.iterdir())
    assert len(files) == 3
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_tampered_disk_block_is_a_counted_miss(store):
    tiers, kv = store
    assert _load(tiers, kv) == [True, True, True]
    # Block 1's bytes replaced by other values, its header's checksum made to match
    # them (what a checksum anyone can compute allows): it must still not load.
    path = tiers.folder / f"{HASHES[1].hex()}.kv"
    data = path.read_bytes()
    (size,) = _HEADER.unpack_from(data)
    header = msgpack.unpackb(data[_HEADER.size : _HEADER.size + size])
    payload = torch.full_like(kv[:, :, 1], 7.0).contiguous().view(torch.uint8).numpy().tobytes()
    header = _forge(header, payload)
    packed = msgpack.packb(header)
    path.write_bytes(_HEADER.pack(len(packed)) + packed + payload)
    assert _load(tiers, kv) == [True, False, True]
    assert tiers.failed_checks == 1


def _forge(header: dict, payload: bytes) -> dict:
    """``header`` with every checksum field recomputed over ``payload`` without a key."""
    out = dict(header)
    for name in ("blake2b", "mac"):
        if name in out:
            out[name] = hashlib.blake2b(payload, digest_size=len(out[name])).digest()
    return out
