"""The nccl connector's pair protocol, on gloo (caches in host memory), in this process.

A sender and a receiver pair over a real two-rank gloo group, as a prefill rank and a
decode rank would (the decode rank's actor is :class:`~tests.fakes.FakeActor`): pages
land where their headers say, whether received straight into the cache or through a
buffer, and a peer that never receives fails the sender's flush within the group's
timeout. (Marks, a close and one request's pages: the pair tests of
tests/transfer/test_connectors.py, which run for p2p and nccl.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch

from pdserve.core.errors import TransferError
from pdserve.transfer import connector_classes, nccl, pairs
from tests.fakes import FAKE_RAY, FakeActor
from tests.transfer.test_connectors import (
    CPU,
    KV_SHAPE,
    MESSAGES,
    PAYLOAD_BYTES,
    assert_landed,
    pair_connected,
    send_all,
)


@pytest.fixture
def prefill_cache() -> torch.Tensor:
    return torch.arange(float(torch.tensor(KV_SHAPE).prod())).view(KV_SHAPE)


@contextmanager
def paired(monkeypatch) -> Iterator[tuple[nccl.NcclSender, nccl.NcclReceiver]]:
    with pair_connected(monkeypatch, "nccl") as (sender, receiver):
        endpoint = sender.endpoints[("d0", 0)]
        assert endpoint.connector == "nccl" and endpoint.address[3] == "gloo"
        yield sender, receiver


def test_the_name_resolves_to_the_pair_connector() -> None:
    sender, receiver = connector_classes("nccl")
    assert sender is nccl.NcclSender and receiver is nccl.NcclReceiver
    assert receiver.needs_arrival_marks
    assert nccl.backend_for(torch.device("cuda", 1)) == "nccl"
    assert nccl.backend_for(CPU) == "gloo"


def test_pages_are_in_place_when_the_end_marks_arrive(monkeypatch, prefill_cache) -> None:
    """Layer 0's run goes straight into consecutive pages; layer 1's runs (scattered
    pages, a head slice, consecutive pages) come as one message, some through a buffer."""
    with paired(monkeypatch) as (sender, receiver):
        send_all(sender, ("d0", 0), prefill_cache)
        for request_id in ("r1", "r2", "r3"):
            sender.finish(("d0", 0), request_id)
        sender.flush()
        for request_id in ("r1", "r2", "r3"):
            assert receiver.wait_landed(request_id, 1, timeout_s=60)
        assert receiver.kv_cache is not None
        assert_landed(receiver.kv_cache, prefill_cache)
        assert receiver.stats.bytes == sender.stats.bytes == PAYLOAD_BYTES
        assert receiver.stats.messages == sender.stats.messages == MESSAGES


def test_a_stuck_peer_fails_the_flush_within_the_timeout_and_a_gone_one_at_once(
    monkeypatch, prefill_cache
) -> None:
    monkeypatch.setattr(nccl, "TIMEOUT", timedelta(seconds=2))
    stuck = threading.Event()
    # the decode rank joins the pair and then never receives (until the test ends)
    monkeypatch.setattr(nccl.NcclReceiver, "serve", lambda self, group, *_: stuck.wait(30))
    with paired(monkeypatch) as (sender, _):
        send_all(sender, ("d0", 0), prefill_cache)
        sender.finish(("d0", 0), "r1")
        start = time.monotonic()
        with pytest.raises(TransferError, match="nccl transfer failed"):
            sender.flush()
        assert time.monotonic() - start < 30  # the group's 2 s, with margin for a busy host
        assert sender.stats.failures == 1
        stuck.set()  # the receiver's thread ends: its side of the pair is closed
        deadline = time.monotonic() + 30
        with pytest.raises(TransferError, match="nccl transfer failed"):
            while time.monotonic() < deadline:  # the next step's sends find the pair gone
                send_all(sender, ("d0", 0), prefill_cache)
                sender.flush()
                time.sleep(0.1)
        assert sender.stats.failures == 2


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_pages_move_between_two_gpus_over_nccl(monkeypatch, prefill_cache) -> None:
    """The decode cache on GPU 0, the prefill cache on GPU 1: an NCCL pair, no host copy."""
    monkeypatch.setattr(pairs, "ray", FAKE_RAY)
    receiver = nccl.NcclReceiver("d0", 0)
    receiver.allocate(KV_SHAPE, torch.float32, torch.device("cuda", 0))
    endpoint = receiver.endpoint(FakeActor(kv_accept=receiver.accept))
    assert endpoint.address[3] == "nccl"
    torch.cuda.set_device(1)
    sender = nccl.NcclSender()
    sender.connect(endpoint)
    source = prefill_cache.to("cuda:1")
    send_all(sender, ("d0", 0), source)
    sender.finish(("d0", 0), "r1")
    sender.flush()
    assert receiver.wait_landed("r1", 1, timeout_s=60)
    assert receiver.kv_cache is not None
    assert_landed(receiver.kv_cache.cpu(), prefill_cache)
    sender.close()
