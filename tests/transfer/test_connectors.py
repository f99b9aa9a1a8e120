"""Each connector moves pages where their header says and nowhere else, without Ray.

A decode rank's actor handle is stood in for by :class:`~tests.fakes.FakeActor`
and the connector module's ``ray`` by :data:`~tests.fakes.FAKE_RAY`. The shared-memory connector maps files in a temporary folder; the p2p
connector builds a real two-rank gloo pair inside this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ray.exceptions import RayActorError

from pdserve.core.errors import TransferError
from pdserve.transfer import (
    connector_classes,
    host_memory,
    object_store,
    p2p,
    pairs,
    shm,
)
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.wire import PageHeader, PageSource
from tests.fakes import FAKE_RAY, FakeActor

CPU = torch.device("cpu")
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 6, 4, 3, 8
KV_SHAPE = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)


@pytest.fixture
def prefill_cache() -> torch.Tensor:
    """A prefill rank's cache, [layers, 2, blocks, bs, heads, D], every element distinct."""
    return torch.arange(float(np.prod(KV_SHAPE))).view(KV_SHAPE)


# (request, layer, source blocks, source heads, destination blocks, destination
# heads): whole consecutive pages (sent and received without a copy), scattered
# pages, and a head slice (re-sharding between TP sizes). Layer 1 has runs of
# three requests, some received straight into the cache and some staged: they
# travel as one message.
SENDS = [
    ("r1", 0, [1, 2], (0, 3), [3, 4], (0, 3)),
    ("r1", 1, [0, 5], (0, 3), [5, 0], (0, 3)),
    ("r2", 1, [2], (1, 3), [1], (0, 2)),
    ("r3", 1, [3, 4], (0, 3), [2, 3], (0, 3)),
]
MESSAGES = 2  # one per layer
PAYLOAD_BYTES = sum(
    4 * 2 * len(src) * BLOCK_SIZE * (h[1] - h[0]) * HEAD_DIM for _, _, src, h, _, _ in SENDS
)


def send_all(sender: Any, peer: tuple[str, int], cache: torch.Tensor) -> None:
    """One ``send`` per layer, with every run of that layer."""
    for layer in range(LAYERS):
        runs = []
        for request_id, at, src, (s0, s1), dst, (d0, d1) in SENDS:
            if at == layer:
                shape = [2, len(src), BLOCK_SIZE, s1 - s0, HEAD_DIM]
                header = PageHeader(request_id, layer, dst, "float32", shape, d0, d1)
                runs.append((header, PageSource(cache[layer], src, s0, s1)))
        sender.send(peer, runs)


def assert_landed(received: torch.Tensor, cache: torch.Tensor) -> None:
    expected = torch.zeros(KV_SHAPE)
    for _, layer, src, (s0, s1), dst, (d0, d1) in SENDS:
        for s, d in zip(src, dst, strict=True):
            expected[layer, :, d, :, d0:d1] = cache[layer, :, s, :, s0:s1]
    assert torch.equal(received, expected)


def test_receiver_write_places_pages_by_header() -> None:
    receiver = object_store.ObjectStoreReceiver("d0", 0)
    receiver.allocate(KV_SHAPE, torch.float32, CPU)
    keys, values = (
        torch.ones(2, BLOCK_SIZE, 2, HEAD_DIM),
        torch.full((2, BLOCK_SIZE, 2, HEAD_DIM), 2.0),
    )
    receiver.write(
        PageHeader("r1", 1, [4, 2], "float32", [2, 2, BLOCK_SIZE, 2, HEAD_DIM], 1, 3), keys, values
    )
    assert receiver.kv_cache is not None
    written = receiver.kv_cache[1, :, [4, 2], :, 1:3]
    assert torch.equal(written[0], keys) and torch.equal(written[1], values)
    assert receiver.kv_cache.sum() == keys.sum() + values.sum()  # nothing else was touched


def test_arrival_marks_are_counted_per_request_until_forgotten() -> None:
    receiver = object_store.ObjectStoreReceiver("d0", 0)
    assert not receiver.wait_landed("r1", 1, timeout_s=0.01)
    receiver.record_mark("r1")
    assert not receiver.wait_landed("r1", 2, timeout_s=0.01)
    receiver.record_mark("r1")
    assert receiver.wait_landed("r1", 2, timeout_s=0.01)
    receiver.forget("r1")
    assert not receiver.wait_landed("r1", 1, timeout_s=0.01)


# -- shared memory ----------------------------------------------------------------------


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    return tmp_path


def test_shm_sender_copies_into_the_receivers_file(shm_dir: Path, prefill_cache) -> None:
    receiver = shm.ShmReceiver("d0", 0)
    cache = receiver.allocate(KV_SHAPE, torch.float32, CPU)
    endpoint = receiver.endpoint(actor=None)
    assert endpoint.address == str(receiver.path) and receiver.path.parent == shm_dir
    assert endpoint.kv_shape == KV_SHAPE and endpoint.dtype == "float32"
    sender = shm.ShmSender()
    sender.connect(endpoint)
    send_all(sender, ("d0", 0), prefill_cache)
    sender.flush()
    assert_landed(cache, prefill_cache)
    assert sender.stats.messages == MESSAGES
    assert sender.stats.bytes == PAYLOAD_BYTES
    sender.disconnect("d0")
    assert sender.endpoints == {}
    receiver.close()
    assert not receiver.path.exists()


def test_shm_cache_file_is_allocated_in_full_when_made(shm_dir: Path) -> None:
    receiver = shm.ShmReceiver("d0", 0)
    cache = receiver.allocate(KV_SHAPE, torch.float32, CPU)
    nbytes = cache.numel() * cache.element_size()
    # every block is on the file system now (a sparse file would have none): the
    # first write of a step no longer allocates, and a full /dev/shm fails here
    assert os.stat(receiver.path).st_blocks * 512 >= nbytes
    assert not cache.any()
    receiver.close()


def _mapped_kib(address: int) -> int:
    """Resident KiB of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_shm_mappings_are_populated_when_made(shm_dir: Path) -> None:
    receiver = shm.ShmReceiver("d0", 0)
    cache = receiver.allocate(KV_SHAPE, torch.float32, CPU)
    kib = cache.numel() * cache.element_size() // 1024
    # every page is in the receiver's page tables before any step wrote one
    assert _mapped_kib(cache.data_ptr()) >= kib
    sender = shm.ShmSender()
    sender.connect(receiver.endpoint(actor=None))
    # and in the sender's mapping of the same file, which it has not written either
    pages = sender._pages[("d0", 0)][0]
    assert _mapped_kib(pages.base) >= kib
    assert not cache.any()
    sender.close()
    receiver.close()


def test_a_file_system_without_room_for_the_cache_is_a_clear_error(shm_dir: Path) -> None:
    stat = os.statvfs(shm_dir)
    too_big = stat.f_bavail * stat.f_frsize + (1 << 30)
    path = shm_dir / "pdserve-kv-too-big"
    try:
        host_memory.reserve_file(path, too_big)
    except TransferError as e:
        assert "no room for the KV cache" in str(e) and str(shm_dir) in str(e)
        assert "--shm-size" in str(e)
        assert not path.exists()
    else:  # a file system without fallocate: sparse, as before
        path.unlink()
        pytest.skip("this file system does not allocate files up front")


def test_the_kv_cache_file_is_private_whatever_was_there(shm_dir: Path) -> None:
    path = shm_dir / "pdserve-kv-private"
    path.write_bytes(b"")
    path.chmod(0o644)  # a file of an earlier run, or of a wider umask
    old = os.umask(0o022)
    try:
        host_memory.reserve_file(path, 1 << 16)
    finally:
        os.umask(old)
        mode = path.stat().st_mode & 0o777
        path.unlink()
    assert mode == 0o600


def test_shm_refuses_a_decode_rank_on_another_node(shm_dir: Path) -> None:
    endpoint = PeerEndpoint("shm", "d0", 0, KV_SHAPE, "float32", str(shm_dir / "elsewhere"))
    with pytest.raises(TransferError, match="not on this node"):
        shm.ShmSender().connect(endpoint)


def test_shm_needs_the_cache_in_host_memory(shm_dir: Path) -> None:
    with pytest.raises(TransferError, match="host memory"):
        shm.ShmReceiver("d0", 0).allocate(KV_SHAPE, torch.float32, torch.device("cuda"))


def test_shm_sweeps_only_files_of_dead_processes(shm_dir: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = shm_dir / f"pdserve-kv-{int(dead.stdout)}-0123456789ab"
    mine = shm_dir / f"pdserve-kv-{os.getpid()}-0123456789ab"
    other = shm_dir / "pdserve-kv-notapid"
    for path in (stale, mine, other):
        path.write_bytes(b"")
    assert shm.sweep_stale_files() == 1
    assert not stale.exists() and mine.exists() and other.exists()


# -- Ray object store -------------------------------------------------------------------


def _readonly_receive(receiver: object_store.ObjectStoreReceiver) -> Callable[..., None]:
    """The decode rank's ``receive_pages``, given buffers read-only as Ray hands them over."""

    def receive_pages(header: bytes, keys: np.ndarray, values: np.ndarray) -> None:
        keys, values = keys.copy(), values.copy()
        keys.setflags(write=False)
        values.setflags(write=False)
        receiver.receive(header, keys, values)

    return receive_pages


def test_object_store_messages_land_once_flushed(monkeypatch, prefill_cache) -> None:
    monkeypatch.setattr(object_store, "ray", FAKE_RAY)
    receiver = object_store.ObjectStoreReceiver("d0", 0)
    cache = receiver.allocate(KV_SHAPE, torch.float32, CPU)
    sender = object_store.ObjectStoreSender()
    sender.connect(receiver.endpoint(FakeActor(receive_pages=_readonly_receive(receiver))))
    send_all(sender, ("d0", 0), prefill_cache)
    sender.flush()
    assert_landed(cache, prefill_cache)
    assert receiver.stats.messages == sender.stats.messages == MESSAGES
    assert receiver.stats.bytes == sender.stats.bytes
    sender.flush()  # nothing pending: returns at once
    assert sender.stats.messages == MESSAGES


def test_object_store_reports_a_lost_decode_rank(monkeypatch, prefill_cache) -> None:
    monkeypatch.setattr(object_store, "ray", FAKE_RAY)

    def dead(*_: Any) -> None:
        raise RayActorError()

    receiver = object_store.ObjectStoreReceiver("d0", 0)
    receiver.allocate(KV_SHAPE, torch.float32, CPU)
    sender = object_store.ObjectStoreSender()
    sender.connect(receiver.endpoint(FakeActor(receive_pages=dead)))
    send_all(sender, ("d0", 0), prefill_cache)
    with pytest.raises(TransferError, match="object-store transfer failed"):
        sender.flush()
    assert sender.stats.failures == 1


# -- torch.distributed point to point ---------------------------------------------------


@contextmanager
def pair_connected(monkeypatch, name: str = "p2p") -> Iterator[tuple[Any, Any]]:
    """A sender paired with a receiver of a pair-group connector (``p2p``, ``nccl``) over
    a real gloo group, both in this process."""
    monkeypatch.setattr(pairs, "ray", FAKE_RAY)
    sender_cls, receiver_cls = connector_classes(name)
    receiver = receiver_cls("d0", 0)
    receiver.allocate(KV_SHAPE, torch.float32, CPU)
    sender = sender_cls()
    sender.connect(receiver.endpoint(FakeActor(kv_accept=receiver.accept)))
    try:
        yield sender, receiver
    finally:
        sender.close()
    for thread in receiver._threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "the receiver did not stop on the close message"


@pytest.fixture(params=["p2p", "nccl"])  # nccl's pair groups are gloo on the CPU
def p2p_pair(monkeypatch, request) -> Iterator[tuple[Any, Any]]:
    with pair_connected(monkeypatch, request.param) as pair:
        yield pair


def test_p2p_pages_are_in_place_when_the_end_mark_arrives(p2p_pair, prefill_cache) -> None:
    sender, receiver = p2p_pair
    send_all(sender, ("d0", 0), prefill_cache)
    sender.finish(("d0", 0), "r1")
    sender.flush()
    # The pair delivers in order: once the mark is counted every page before it landed.
    assert receiver.wait_landed("r1", 1, timeout_s=60)
    assert receiver.kv_cache is not None
    assert_landed(receiver.kv_cache, prefill_cache)
    assert receiver.stats.messages == MESSAGES
    assert sender.stats.messages == MESSAGES  # the mark carries no pages


def test_p2p_marks_of_two_requests_are_told_apart(p2p_pair) -> None:
    sender, receiver = p2p_pair
    sender.finish(("d0", 0), "a")
    sender.finish(("d0", 0), "a")
    sender.finish(("d0", 0), "b")
    sender.flush()
    assert receiver.wait_landed("a", 2, timeout_s=60)
    assert receiver.wait_landed("b", 1, timeout_s=60)
    assert not receiver.wait_landed("b", 2, timeout_s=0.05)


def test_p2p_disconnect_closes_the_pair(p2p_pair) -> None:
    sender, receiver = p2p_pair
    sender.disconnect("d0")
    assert sender.endpoints == {}
    for thread in receiver._threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


class CountingGroup:
    """A gloo group that counts the sends posted on each tag."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.sends: dict[int, int] = {}

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.sends[tag] = self.sends.get(tag, 0) + 1
        return self.group.send(tensors, dst, tag)


# Layer 0 carries 768 bytes of K (and of V), layer 1 1792: with 1 KiB of
# inline staging, layer 0 goes inline and layer 1 direct.
@pytest.mark.parametrize(
    ("inline_part", "sends"),
    [(1 << 20, {0: MESSAGES + 1, 1: 2 * MESSAGES}), (1024, {0: MESSAGES + 1, 1: 2, 2: 2 * 3})],
    ids=["inline", "inline-and-direct"],
)
def test_p2p_sends_a_layer_of_several_requests_as_one_message(
    monkeypatch, prefill_cache, inline_part: int, sends: dict[int, int]
) -> None:
    """One header send per message and its parts (all K, all V inline; K, V per run direct).

    The step's marks travel as one more message.
    """
    monkeypatch.setattr(p2p, "INLINE_PART", inline_part)
    with pair_connected(monkeypatch) as (sender, receiver):
        counting = CountingGroup(sender._groups[("d0", 0)])
        sender._groups[("d0", 0)] = counting
        send_all(sender, ("d0", 0), prefill_cache)
        for request_id in ("r1", "r2", "r3"):
            sender.finish(("d0", 0), request_id)
        sender.flush()
        sender._groups[("d0", 0)] = counting.group
        assert counting.sends == sends
        for request_id in ("r1", "r2", "r3"):
            assert receiver.wait_landed(request_id, 1, timeout_s=60)
        assert receiver.kv_cache is not None
        assert_landed(receiver.kv_cache, prefill_cache)
        assert receiver.stats.bytes == sender.stats.bytes == PAYLOAD_BYTES
        assert receiver.stats.messages == sender.stats.messages == MESSAGES


def test_p2p_splits_a_header_longer_than_the_slot(monkeypatch, prefill_cache) -> None:
    monkeypatch.setattr(p2p, "HEADER_SLOT", 60)  # two runs' header (about 51 bytes) at most
    with pair_connected(monkeypatch) as (sender, receiver):
        counting = CountingGroup(sender._groups[("d0", 0)])
        sender._groups[("d0", 0)] = counting
        send_all(sender, ("d0", 0), prefill_cache)
        sender.finish(("d0", 0), "r1")
        sender.flush()
        sender._groups[("d0", 0)] = counting.group
        assert counting.sends == {0: MESSAGES + 2, 1: 2 * (MESSAGES + 1)}  # layer 1 in two
        assert receiver.wait_landed("r1", 1, timeout_s=60)
        assert receiver.kv_cache is not None
        assert_landed(receiver.kv_cache, prefill_cache)
        many = [PageHeader("r", 0, list(range(BLOCKS)) * 20, "float32", [2, 120, 4, 3, 8], 0, 3)]
        with pytest.raises(TransferError, match="exceeds the p2p header slot"):
            sender._post(("d0", 0), many, [], [], [])
