"""KV connector bandwidth against the raw channel underneath it, in one run.

    pdserve bench transfer

For each connector, a Ray actor plays the decode rank (its real receiver and
KV cache) and this process plays the prefill rank (the real sender): pages of
one layer go out as messages of :class:`~pdserve.transfer.wire.PageSource`
runs (``--requests`` runs per message, one per request) and ``flush`` waits
until they landed. The raw channel moves the same bytes with nothing of
pdserve in the way:

- shm: one ``copy_`` between two tensors of this process (a memory copy);
- p2p and nccl: a plain gloo send/recv of a byte tensor between the same two
  processes (nccl's pair groups are gloo for caches in host memory);
- object_store: a Ray call carrying the same bytes as one numpy array, which
  the actor copies into a buffer of its own (the connector copies them into
  the KV cache).

With ``--nodes 2`` the actor runs on a second Ray node (a raylet and object store
of its own, on this machine: ``ray.cluster_utils.Cluster``), so the object store
moves every message between nodes; shm, which reaches only its own node, is left
out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as NodeAffinity

from pdserve.bench.flags import count
from pdserve.bench.nodes import local_nodes
from pdserve.bench.report import write_json
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.transfer import connector_classes
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.object_store import ObjectStoreReceiver
from pdserve.transfer.pairs import PairReceiver
from pdserve.transfer.wire import PageHeader, PageRun, PageSource

BLOCK, HEADS, DIM = 16, 8, 128  # one page of one layer: 2 * 16 * 8 * 128 * 4 B = 128 KiB
RAW_GLOO_TIMEOUT = timedelta(minutes=30)  # gloo's own default for a process group


@dataclass(frozen=True)
class TransferOptions:
    """``pdserve bench transfer``'s options, in the order of its flags."""

    connectors: list[str] = field(default_factory=lambda: ["shm", "p2p", "object_store"])
    pages: list[int] = field(default_factory=lambda: [8, 32, 128])  # pages per message
    rounds: int = 10  # messages per timed batch
    repeats: int = 7  # interleaved batches
    requests: int = 1  # requests whose pages share each message
    apart: bool = False  # a free page between the requests' destination pages
    nodes: int = 1  # 2: the decode rank on a second Ray node
    out: str = "bench/out/transfer.json"  # the result file ("": none)


class DecodeRankStandIn:
    """A decode rank's receiving half, with nothing else (Ray actor body)."""

    def __init__(self, connector: str, num_blocks: int) -> None:
        _, receiver_cls = connector_classes(connector)
        self.receiver = receiver_cls("bench-decode", 0)
        self.receiver.allocate(
            (1, 2, num_blocks, BLOCK, HEADS, DIM), torch.float32, torch.device("cpu")
        )
        self._raw: Any = None
        self._landing = np.empty(0, dtype=np.uint8)

    def endpoint(self) -> PeerEndpoint:
        return self.receiver.endpoint(ray.get_runtime_context().current_actor)

    def receive_pages(self, header: bytes, keys: np.ndarray, values: np.ndarray) -> None:
        assert isinstance(self.receiver, ObjectStoreReceiver), "not the object-store connector"
        self.receiver.receive(header, keys, values)

    def kv_accept(self, pair_id: str) -> None:
        assert isinstance(self.receiver, PairReceiver), "not a pair connector"
        self.receiver.accept(pair_id)

    def land(self, payload: np.ndarray) -> int:
        """Raw channel for the object store: receive bytes and copy them into memory."""
        if self._landing.size < payload.size:
            self._landing = np.empty(payload.size, dtype=np.uint8)
        np.copyto(self._landing[: payload.size], payload.reshape(-1))
        return int(payload.nbytes)

    def raw_gloo_listen(self, nbytes: int, count: int) -> tuple[str, int]:
        import threading

        import torch.distributed as dist

        from pdserve.parallel.groups import _node_ip

        store = dist.TCPStore(_node_ip(), 0, 2, is_master=True, wait_for_workers=False)

        def serve() -> None:
            group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, RAW_GLOO_TIMEOUT)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            for _ in range(count):
                # torch's stub of ProcessGroupGloo leaves out send and recv (it has them)
                group.recv([buf], 1, 0).wait()  # type: ignore[attr-defined]
            self._raw = group

        threading.Thread(target=serve, daemon=True).start()
        self._store = store
        return store.host, store.port


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _batch_rate(one_round: Callable[[], object], nbytes: int, rounds: int) -> float:
    """GB/s of ``rounds`` back-to-back rounds of ``nbytes`` each."""
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
    return _rate(nbytes * rounds, time.perf_counter() - start)


def _start_stand_in(connector: str, num_blocks: int, node_id: str | None = None) -> Any:
    """Start the decode rank's actor (on node ``node_id`` when given); Ray types the
    handle as handle-or-class, so Any."""
    where = {} if node_id is None else {"scheduling_strategy": NodeAffinity(node_id, soft=False)}
    return (
        ray.remote(DecodeRankStandIn)
        .options(num_cpus=0, max_concurrency=8, **where)
        .remote(connector, num_blocks)
    )


def _runs(src: torch.Tensor, pages: int, requests: int, apart: bool = False) -> list[PageRun]:
    """One message: ``pages`` pages of layer 0, every head, into blocks from ``pages`` on.

    The pages are split into ``requests`` runs of consecutive pages, one per
    request, as a step streaming several prompts to one decode rank sends them.
    With ``apart``, one free page separates the requests' destination pages, so
    no two runs can be copied as one.
    """
    runs: list[PageRun] = []
    per = pages // requests
    for i in range(requests):
        first = i * per
        n = per if i < requests - 1 else pages - first
        to = pages + first + (i if apart else 0)
        header = PageHeader(
            f"bench-{i}",
            0,
            list(range(to, to + n)),
            "float32",
            [2, n, BLOCK, HEADS, DIM],
            0,
            HEADS,
        )
        runs.append((header, PageSource(src, list(range(first, first + n)), 0, HEADS)))
    return runs


def measure(
    connector: str,
    pages: int,
    rounds: int,
    repeats: int,
    requests: int = 1,
    apart: bool = False,
    node_id: str | None = None,
) -> dict[str, Any]:
    """Median GB/s of the connector and of its raw channel, ``repeats`` batches each
    (the decode rank on Ray node ``node_id`` when given)."""
    num_blocks = pages * 2 + (requests if apart else 0)
    actor = _start_stand_in(connector, num_blocks, node_id)
    endpoint: PeerEndpoint = ray.get(actor.endpoint.remote())
    sender_cls, _ = connector_classes(connector)
    sender = sender_cls()
    sender.connect(endpoint)
    src = torch.randn(2, num_blocks, BLOCK, HEADS, DIM)
    runs = _runs(src, pages, requests, apart)
    nbytes = sum(header.nbytes for header, _ in runs)

    def connector_round() -> None:
        sender.send(("bench-decode", 0), runs)
        sender.flush()

    connector_round()  # warm-up
    raw_round = _raw_channel(connector, actor, src, nbytes, rounds * repeats + 1)
    raw_round()
    ours, raw = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine
        ours.append(_batch_rate(connector_round, nbytes, rounds))
        raw.append(_batch_rate(raw_round, nbytes, rounds))
    ours_gb, raw_gb = statistics.median(ours), statistics.median(raw)
    sender.close()
    ray.kill(actor)
    return {
        "connector": connector,
        "nodes": 1 if node_id is None else 2,
        "message_mib": round(nbytes / 2**20, 2),
        "requests": requests,
        "apart": apart,
        "connector_gb_s": round(ours_gb, 2),
        "raw_gb_s": round(raw_gb, 2),
        "ratio": round(ours_gb / raw_gb, 2),
    }


def _raw_channel(
    connector: str, actor: Any, src: torch.Tensor, nbytes: int, total: int
) -> Callable[[], object]:
    """One message's worth of bytes over the bare channel, as a callable."""
    pages = nbytes // src[:, 0].nbytes  # the same bytes as one message
    payload = src[:, :pages].contiguous()
    assert payload.nbytes == nbytes
    if connector == "shm":
        dst = torch.empty_like(payload)
        return lambda: dst.copy_(payload)
    if connector == "object_store":
        array = payload.view(torch.uint8).numpy()
        return lambda: ray.get(actor.land.remote(array))
    import torch.distributed as dist

    host, port = ray.get(actor.raw_gloo_listen.remote(nbytes, total))
    store = dist.TCPStore(host, port, 2, is_master=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, RAW_GLOO_TIMEOUT)
    data = payload.view(torch.uint8).reshape(-1)
    return lambda: group.send([data], 0, 0).wait()  # type: ignore[attr-defined]  # stub lacks send


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(TransferOptions, args))


def benchmark(args: TransferOptions) -> int:
    """Each connector at each message size against the raw channel; written."""
    if args.nodes == 2 and "shm" in args.connectors:
        raise InvalidArgumentError(
            "connectors", "shm reaches only its own node: not with --nodes 2"
        )
    with contextlib.ExitStack() as stack:
        node_id = stack.enter_context(local_nodes([(1, {})]))[0] if args.nodes == 2 else None
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        rows = []
        for connector in args.connectors:
            for pages in args.pages:
                row = measure(
                    connector, pages, args.rounds, args.repeats, args.requests, args.apart, node_id
                )
                rows.append(row)
                print(json.dumps(row))
    if args.out:
        cmd = (
            f"pdserve bench transfer --connectors {' '.join(args.connectors)} "
            f"--pages {' '.join(map(str, args.pages))} "
            f"--rounds {args.rounds} --repeats {args.repeats} --requests {args.requests}"
            + (" --apart" if args.apart else "")
            + (f" --nodes {args.nodes}" if args.nodes != 1 else "")
        )
        write_json(Path(args.out), {"command": cmd, "results": rows})
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connectors", nargs="+", default=["shm", "p2p", "object_store"])
    p.add_argument("--pages", nargs="+", type=count, default=[8, 32, 128], help="pages per message")
    p.add_argument("--rounds", type=count, default=10, help="messages per timed batch")
    p.add_argument("--repeats", type=count, default=7, help="interleaved batches; medians reported")
    p.add_argument(
        "--requests", type=count, default=1, help="requests whose pages share each message"
    )
    p.add_argument(
        "--apart",
        action="store_true",
        help="a free page between the requests' destination pages (no runs merge)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: the decode rank on a second Ray node started on this machine",
    )
    p.add_argument("--out", default="bench/out/transfer.json")
    p.set_defaults(func=run)


__all__ = ["add_arguments", "run"]
