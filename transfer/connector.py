"""The connector seam: how KV pages get from a prefill rank into a decode rank's cache.

Each connector has two halves, one per process:

- :class:`KVReceiver` lives in a decode rank. It publishes a
  :class:`PeerEndpoint` (what a sender needs to reach it) and writes arriving
  pages into that rank's KV cache. It never allocates or frees pages: the
  decode instance's scheduler reserved them under a lease before any byte moved.
- :class:`KVSender` lives in a prefill rank. ``connect`` runs once per decode
  rank when two instances pair. ``send`` runs once per (decode rank, layer,
  step) from the forward pass, right after the layer wrote its KV, with every
  run of pages that layer has for that rank (one per request and route): the
  connector moves them as one message with one header. It may return before
  the bytes land. ``finish`` runs once per route when a request's last
  pages were sent. ``flush`` runs at the end of every step that sent: it
  returns when everything sent so far has landed, or raises
  :class:`~pdserve.core.errors.TransferError`. Source pages stay owned by the prefill request
  (held until the decode instance acknowledges the hand-off).

A connector whose sender cannot tell that bytes landed (``needs_arrival_marks``)
has ``finish`` send an end-of-transfer mark; the decode rank waits for one mark
per route before the request runs.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, ClassVar

import torch

from pdserve.core.errors import TransferError
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.stats import TransferStats
from pdserve.transfer.wire import PageHeader, PageRun, block_runs


class KVReceiver(abc.ABC):
    """Decode-rank half. Created before the KV cache, which it may allocate."""

    name: ClassVar[str]
    needs_arrival_marks: ClassVar[bool] = False

    def __init__(self, instance_id: str, rank: int) -> None:
        self.instance_id = instance_id
        self.rank = rank
        self.stats = TransferStats(name_of(type(self)))
        self.kv_cache: torch.Tensor | None = None
        self._marks: dict[str, int] = {}
        self._marked = threading.Condition()

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The rank's KV cache tensor (zeros); shared-memory connectors override this."""
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        return self.kv_cache

    @abc.abstractmethod
    def endpoint(self, actor: Any) -> PeerEndpoint:
        """What senders need; ``actor`` is this rank's Ray actor handle."""

    def write(self, header: PageHeader, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Place one run's pages: ``keys``/``values`` ``[pages, bs, heads, D]`` each.

        Counts nothing: the caller counts the message the run came in.
        """
        assert self.kv_cache is not None
        dst = self.kv_cache[header.layer]  # [2, blocks, bs, H_local, D]
        h0, h1 = header.head_start, header.head_end
        runs = block_runs(list(range(len(header.block_ids))), header.block_ids)
        for i, part in enumerate((keys, values)):
            part = part.to(dst.device)
            for s, d, n in runs:
                dst[i, d : d + n, :, h0:h1].copy_(part[s : s + n])

    def record_mark(self, request_id: str) -> None:
        """One route into this rank finished sending ``request_id``."""
        with self._marked:
            self._marks[request_id] = self._marks.get(request_id, 0) + 1
            self._marked.notify_all()

    def wait_landed(self, request_id: str, expected_marks: int, timeout_s: float) -> bool:
        """Block until ``expected_marks`` routes finished ``request_id``; False on timeout."""
        with self._marked:
            return self._marked.wait_for(
                lambda: self._marks.get(request_id, 0) >= expected_marks, timeout_s
            )

    def forget(self, request_id: str) -> None:
        """Drop any state of a request (it ran, expired or was aborted)."""
        with self._marked:
            self._marks.pop(request_id, None)

    def close(self) -> None:
        pass


class KVSender(abc.ABC):
    """Prefill-rank half, one per connector kind per prefill rank."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self.stats = TransferStats(name_of(type(self)))
        self.endpoints: dict[tuple[str, int], PeerEndpoint] = {}

    def connect(self, endpoint: PeerEndpoint) -> None:
        if endpoint.connector != self.name:
            raise TransferError(
                f"decode rank {endpoint.instance_id}/{endpoint.rank} takes pages over "
                f"{endpoint.connector}, this prefill rank sends over {self.name}: "
                "give both instances one connector"
            )
        self.endpoints[(endpoint.instance_id, endpoint.rank)] = endpoint

    @abc.abstractmethod
    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        """Queue one message of pages for decode rank ``peer``; may return before they land.

        ``runs`` are one layer's runs for that rank (one per request), sent
        with one header. Their sources must stay unchanged until ``flush``
        returns (the step that wrote them is still running, so they do).
        """

    def finish(self, peer: tuple[str, int], request_id: str) -> None:
        """The last pages of ``request_id`` on this route were sent."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Block until every queued message landed; raise TransferError otherwise."""

    def disconnect(self, instance_id: str) -> None:
        for key in [k for k in self.endpoints if k[0] == instance_id]:
            del self.endpoints[key]

    def close(self) -> None:
        pass


def name_of(cls: type) -> str:
    return str(getattr(cls, "name", cls.__name__))


CONNECTORS: dict[str, tuple[type[KVSender], type[KVReceiver]]] = {}


def register(name: str, sender: type[KVSender], receiver: type[KVReceiver]) -> None:
    sender.name = name
    receiver.name = name
    CONNECTORS[name] = (sender, receiver)
