"""What the two pair-group connectors (``p2p``, ``nccl``) share: how a pair is made,
and the sender's bookkeeping of marks and sends in flight.

Every (prefill rank, decode rank) pair gets a two-process ``torch.distributed``
group of its own, made outside either instance's process group: the decode rank
listens on a TCP store; a sender names a fresh pair id, asks the decode rank's
actor to accept it (``kv_accept``), and both build the pair group under that
prefix, the decode rank as rank 0. The decode rank receives on each pair in a
thread of its own. What goes over the group, and on which backend, is each
connector's.

A sender queues each request's end-of-transfer mark (``finish``); ``flush``
sends a step's marks to each rank as one message, then waits for every send of
the step, keeping each one's tensors until then.
"""

from __future__ import annotations

import abc
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.wire import dtype_name

STORE_TIMEOUT = timedelta(seconds=60)  # how long a pair's rendezvous may take


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a view: what a pair sends or receives into (a
    receive into a copy would be lost)."""
    assert t.is_contiguous(), "a send or receive buffer must be contiguous"
    return t.view(torch.uint8).reshape(-1)


def node_ip() -> str:
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


class PairReceiver(KVReceiver):
    """Decode-rank half: the store senders rendezvous on, and a receiving thread per pair."""

    needs_arrival_marks = True

    def __init__(self, instance_id: str, rank: int) -> None:
        super().__init__(instance_id, rank)
        self._store = dist.TCPStore(
            node_ip(), 0, 2, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        self._threads: list[threading.Thread] = []

    def endpoint(self, actor: Any) -> PeerEndpoint:
        assert self.kv_cache is not None
        return PeerEndpoint(
            self.name,
            self.instance_id,
            self.rank,
            tuple(self.kv_cache.shape),
            dtype_name(self.kv_cache.dtype),
            (self._store.host, self._store.port, actor, *self.address_extras()),
        )

    def address_extras(self) -> tuple[Any, ...]:
        """What a sender needs besides the store and the actor (none by default)."""
        return ()

    def accept(self, pair_id: str) -> None:
        """Join a sender's pair group (rank 0 of 2) and receive on it in a thread."""
        group = self.join(dist.PrefixStore(pair_id, self._store))
        thread = threading.Thread(
            target=self.serve,
            args=(group, pair_id),
            daemon=True,
            name=f"pdserve-{self.name}-{pair_id[-6:]}",
        )
        thread.start()
        self._threads.append(thread)

    @abc.abstractmethod
    def join(self, store: Any) -> Any:
        """This rank's side (rank 0) of the pair group on ``store``."""

    @abc.abstractmethod
    def serve(self, group: Any, pair_id: str) -> None:
        """Receive the pair's messages until it closes or fails (the pair's thread)."""


class PairSender(KVSender):
    """Prefill-rank half: a pair group per decode rank, marks and sends in flight."""

    def __init__(self) -> None:
        super().__init__()
        self._groups: dict[tuple[str, int], Any] = {}  # per decode rank: what ``join`` made
        self._marks: dict[tuple[str, int], list[str]] = {}
        # (works, tensors they read, payload bytes): kept until the works completed.
        self._pending: list[tuple[list[Any], list[torch.Tensor], int]] = []

    def connect(self, endpoint: PeerEndpoint) -> None:
        super().connect(endpoint)
        host, port, actor, *extras = endpoint.address
        pair_id = f"{self.name}-{uuid.uuid4().hex}"
        accepted = actor.kv_accept.remote(pair_id)
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=STORE_TIMEOUT)
        link = self.join(dist.PrefixStore(pair_id, store), *extras)
        ray.get(accepted)
        self._groups[(endpoint.instance_id, endpoint.rank)] = link

    @abc.abstractmethod
    def join(self, store: Any, *extras: Any) -> Any:
        """This rank's side (rank 1) of the pair group on ``store``, as ``send`` uses it."""

    @abc.abstractmethod
    def post_marks(self, peer: tuple[str, int], request_ids: list[str]) -> None:
        """Send a message of end-of-transfer marks only (it joins the pending sends)."""

    @abc.abstractmethod
    def close_pair(self, link: Any) -> None:
        """Tell the decode rank the pair is closing (best effort)."""

    def pending(self, works: list[Any], tensors: list[torch.Tensor], nbytes: int) -> None:
        """Sends posted for one message: waited for by the next ``flush``."""
        self._pending.append((works, tensors, nbytes))

    def finish(self, peer: tuple[str, int], request_id: str) -> None:
        """Queue the mark; ``flush`` sends a step's marks to a rank as one message."""
        self._marks.setdefault(peer, []).append(request_id)

    def flush(self) -> None:
        marks, self._marks = self._marks, {}
        for peer, request_ids in marks.items():
            self.post_marks(peer, request_ids)
        pending, self._pending = self._pending, []
        if not pending:
            return
        start = time.perf_counter()
        try:
            for works, _, _ in pending:
                for w in works:
                    w.wait()
        except RuntimeError as e:  # the peer is gone, or did not receive in the group's timeout
            self.stats.failures += 1
            raise TransferError(f"{self.name} transfer failed: {e}") from e
        carried = [n for _, _, n in pending if n]
        self.stats.add(sum(carried), time.perf_counter() - start, messages=len(carried))

    def disconnect(self, instance_id: str) -> None:
        for key in [k for k in self._groups if k[0] == instance_id]:
            self._marks.pop(key, None)
            self.close_pair(self._groups.pop(key))
        super().disconnect(instance_id)

    def close(self) -> None:
        for link in self._groups.values():
            self.close_pair(link)
        self._groups.clear()
        self._marks.clear()
