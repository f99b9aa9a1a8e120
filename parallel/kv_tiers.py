"""One rank's bytes of the host and disk KV tiers, and the step's tier ops on them.

The engine's index (:mod:`pdserve.engine.kv_tiers`) decides what goes where; a
rank keeps its own shard of every offloaded block::

    host tier   one tensor [slots, layers, 2, block_size, kv_heads, head_dim]
                (pinned on CUDA), a slot per block
    disk tier   one file per block hash in a folder of this rank (0600 files in a
                0700 folder): [4-byte header length][msgpack header][raw bytes];
                the header carries the hash, dtype, shape and a MAC of them and
                the bytes (keyed blake2b)

The MAC's key is drawn at random by each rank's store and never leaves its
process: the folder is this rank's alone (named after its process, removed when
it closes, and a dead process's folder is removed, never read), so no other
process needs it. A file that someone with access to the disk writes (planted,
or a block of another rank or run) fails the MAC like a corrupt one.

Each step the rank first runs the writes that read device blocks the step
reuses, then the plan's loads (a disk file that is missing, for another hash,
or fails its MAC is a failed load, reported to the engine as a cache miss and
counted in ``failed_loads``), then starts the other writes on a background thread while the forward
runs, and waits for them before the step returns.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgpack
import torch

from pdserve.core.config import CacheConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.private_files import open_private, private_dir
from pdserve.core.step import TierLoad, TierOps, TierWrite

logger = logging.getLogger(__name__)

_DIR_PREFIX = "pdserve-kv-"
_HEADER = struct.Struct("<I")


class TierIO:
    """Bytes and seconds moved per tier and direction ("in": written down, "out": loaded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: dict[tuple[str, str], int] = {}
        self.seconds: dict[tuple[str, str], float] = {}

    def add(self, tier: str, direction: str, nbytes: int, seconds: float) -> None:
        key = (tier, direction)
        with self._lock:
            self.bytes[key] = self.bytes.get(key, 0) + nbytes
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds


def tier_slots(cache: CacheConfig, bytes_per_block: int) -> tuple[int, int]:
    """Blocks the host and disk tiers of one rank hold within their byte budgets."""
    if not cache.tiers_enabled:
        return 0, 0
    for name in ("host_tier_bytes", "disk_tier_bytes"):
        budget = getattr(cache, name)
        if 0 < budget < bytes_per_block:  # a tier that would hold nothing is not quietly off
            raise InvalidArgumentError(
                name, f"{budget} bytes hold no KV block: one block takes {bytes_per_block}"
            )
    return cache.host_tier_bytes // bytes_per_block, cache.disk_tier_bytes // bytes_per_block


class TierStore:
    """The host slots and disk files of one rank."""

    def __init__(self, cache: CacheConfig, host_slots: int, disk_slots: int, rank: str) -> None:
        self.host: torch.Tensor | None = None
        self._host_slots = host_slots
        self.folder: Path | None = None
        if disk_slots > 0:
            assert cache.disk_tier_path is not None
            self.folder = _rank_folder(Path(cache.disk_tier_path), cache.disk_tier_bytes, rank)
        if host_slots > 0:
            _check_host_memory(cache.host_tier_bytes)
        self.io = TierIO()
        self.failed_writes = 0
        self.failed_checks = 0  # disk files that were unreadable or failed their MAC
        self._mac_key = secrets.token_bytes(32)  # this process's alone (module docstring)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-tier")
        self._writing: Future[None] | None = None

    def _host(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The host buffer, shaped like ``kv_cache``'s blocks (made on first use)."""
        block_shape = (kv_cache.shape[0], 2, *kv_cache.shape[3:])
        if self.host is None or self.host.shape[1:] != block_shape:
            pin = kv_cache.device.type == "cuda"
            self.host = torch.zeros(
                (self._host_slots, *block_shape), dtype=kv_cache.dtype, pin_memory=pin
            )
        return self.host

    # -- the step ---------------------------------------------------------------------

    def start(self, ops: TierOps, kv_cache: torch.Tensor) -> list[bool]:
        """Run the leading writes and the loads; start the other writes. A flag per load."""
        self._write_all(ops.writes[: ops.sync_writes], kv_cache)
        ok = [self._load(load, kv_cache) for load in ops.loads]
        if len(ops.writes) > ops.sync_writes:
            rest = ops.writes[ops.sync_writes :]
            self._writing = self._pool.submit(self._write_all, rest, kv_cache)
        return ok

    def finish(self) -> None:
        """Wait for the step's writes (call before the step returns)."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def _load(self, load: TierLoad, kv_cache: torch.Tensor) -> bool:
        start = time.perf_counter()
        if load.tier == "host":
            block = self._host(kv_cache)[load.slot]
        else:
            got = self._read(load.block_hash, kv_cache)
            if got is None:
                return False
            block = got
        kv_cache[:, :, load.block].copy_(block.to(kv_cache.device))
        nbytes = block.numel() * block.element_size()
        self.io.add(load.tier, "out", nbytes, time.perf_counter() - start)
        return True

    def _write_all(self, writes: list[TierWrite], kv_cache: torch.Tensor) -> None:
        for write in writes:  # in order: a demotion reads a slot before a store reuses it
            try:
                self._write(write, kv_cache)
            except OSError as e:  # a missing file is a miss later, never wrong data
                self.failed_writes += 1
                logger.warning("KV tier %s of %s failed: %s", write.kind, write.block_hash.hex(), e)

    def _write(self, write: TierWrite, kv_cache: torch.Tensor) -> None:
        start = time.perf_counter()
        if write.kind == "drop":
            self._path(write.block_hash).unlink(missing_ok=True)
            return
        if write.kind == "store":
            host = self._host(kv_cache)
            host[write.slot].copy_(kv_cache[:, :, write.block])
            block = host[write.slot]
            tier = "host"
        else:
            tier = "disk"
            if write.kind == "save":
                block = kv_cache[:, :, write.block].cpu()
            else:
                block = self._host(kv_cache)[write.slot]
            self._save(write.block_hash, block)
        nbytes = block.numel() * block.element_size()
        self.io.add(tier, "in", nbytes, time.perf_counter() - start)

    # -- disk files -------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        assert self.folder is not None
        return self.folder / f"{block_hash.hex()}.kv"

    def _save(self, block_hash: bytes, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        fields = {
            "hash": block_hash,
            "dtype": str(block.dtype).removeprefix("torch."),
            "shape": list(block.shape),
        }
        header = msgpack.packb({**fields, "mac": self._mac(fields, payload)})
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        with open_private(tmp, "wb") as f:
            f.write(_HEADER.pack(len(header)) + header + payload)
        os.replace(tmp, path)

    def _read(self, block_hash: bytes, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The block stored under ``block_hash``, or None if missing or not intact."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
            (size,) = _HEADER.unpack_from(data)
            header = msgpack.unpackb(data[_HEADER.size : _HEADER.size + size])
            payload = data[_HEADER.size + size :]
            shape = [kv_cache.shape[0], 2, *kv_cache.shape[3:]]
            fields = {
                "hash": block_hash,
                "dtype": str(kv_cache.dtype).removeprefix("torch."),
                "shape": shape,
            }
            intact = all(header[k] == v for k, v in fields.items()) and hmac.compare_digest(
                header["mac"], self._mac(fields, payload)
            )
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            if not isinstance(e, FileNotFoundError):
                self.failed_checks += 1
            logger.warning("KV disk block %s unreadable: %s", block_hash.hex(), e)
            return None
        if not intact:
            self.failed_checks += 1
            logger.warning("KV disk block %s failed its MAC; recomputing", block_hash.hex())
            path.unlink(missing_ok=True)
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(kv_cache.dtype).view(shape)

    def _mac(self, fields: Mapping[str, object], payload: bytes) -> bytes:
        """The keyed hash of a block's header fields and bytes."""
        mac = hashlib.blake2b(msgpack.packb(fields), key=self._mac_key, digest_size=32)
        mac.update(payload)
        return mac.digest()

    def num_files(self) -> int:
        return 0 if self.folder is None else sum(1 for _ in self.folder.glob("*.kv"))

    def close(self) -> None:
        """Finish pending writes and delete this rank's disk folder."""
        self.finish()
        self._pool.shutdown(wait=True)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _rank_folder(root: Path, budget: int, rank: str) -> Path:
    """A fresh folder for this rank under ``root``; folders of dead processes are removed."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".{_DIR_PREFIX}probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InvalidArgumentError("disk_tier_path", f"{root} is not writable: {e}") from None
    free = shutil.disk_usage(root).free
    if budget > free:
        raise InvalidArgumentError(
            "disk_tier_bytes", f"{budget} bytes asked but {root} has {free} free"
        )
    _remove_stale(root)
    folder = root / f"{_DIR_PREFIX}{os.getpid()}-{rank}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o700)
    return private_dir(folder)  # 0700 whatever the umask


def _remove_stale(root: Path) -> None:
    """Delete tier folders whose process is gone (an instance that died keeps nothing)."""
    for folder in root.glob(f"{_DIR_PREFIX}*"):
        pid = folder.name.removeprefix(_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_host_memory(budget: int) -> None:
    available = _available_memory()
    if available is not None and budget > available:
        raise InvalidArgumentError(
            "host_tier_bytes", f"{budget} bytes asked but the machine has {available} available"
        )


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
