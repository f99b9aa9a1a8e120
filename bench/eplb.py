"""EPLB: imbalance and MoE step time under skewed routing, before and after re-placement.

    pdserve bench eplb

One MoE layer (:class:`~pdserve.models.moe.SparseMoE`) over two EP ranks,
each a process of one torch thread with a gloo group (no Ray, no engine: the
layer alone). The router is skewed: every token carries a constant feature
and the gate gives experts 6 and 7 a bias (``--bias``) on it, so most tokens
pick them; statically they share rank 1. Each step is one forward of
``--tokens`` tokens. One copy of the layer keeps the static placement (its
``--redundant`` slots hold replicas of experts 0, 1, ...); a second copy counts
one step's tokens, is re-placed from them (:func:`pdserve.models.eplb.place`),
and then both copies run ``--steps`` steps in turn, so a busy spell of the
shared host hits both alike. Reported side by side: the imbalance ratio by
rank (max over mean of the rows each rank's slots computed), the median step
time, and the largest difference between the two copies' outputs (replicas
hold the same weights: only float summation order may differ).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import options_from
from pdserve.distributed.context import ParallelContext
from pdserve.models.eplb import imbalance, place, static_placement
from pdserve.models.layers import TensorSource
from pdserve.models.moe import W2_DOWN, SparseMoE


@dataclass(frozen=True)
class EplbOptions:
    """``pdserve bench eplb``'s options, in the order of its flags."""

    hidden: int = 1024  # hidden size
    inter: int = 2048  # each expert's intermediate size
    tokens: int = 256  # tokens per step
    redundant: int = 2  # redundant expert slots
    bias: float = 4.0  # router bias of the hot experts
    steps: int = 10  # timed forwards per phase
    out: str = "bench/out/eplb.json"  # the result file ("": none)


@dataclass(frozen=True)
class EplbSetup:
    experts: int = 8
    top_k: int = 2
    hidden: int = 1024
    inter: int = 2048
    tokens: int = 256
    ep: int = 2
    redundant: int = 2
    hot: tuple[int, ...] = (6, 7)
    bias: float = 4.0
    steps: int = 10
    seed: int = 0


def _weights(s: EplbSetup) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(s.seed)
    gate = torch.randn(s.experts, s.hidden, generator=g) / s.hidden**0.5
    gate[:, 0] = 0.0
    gate[list(s.hot), 0] = s.bias  # the router's bias, through the constant feature
    x = torch.randn(s.tokens, s.hidden, generator=g)
    x[:, 0] = 1.0
    return {
        "gate": gate,
        "gate_up": torch.randn(s.experts, 2 * s.inter, s.hidden, generator=g) / s.hidden**0.5,
        "down": torch.randn(s.experts, s.hidden, s.inter, generator=g) / s.inter**0.5,
        "x": x,
    }


def _build(s: EplbSetup, ctx: ParallelContext, w: dict[str, torch.Tensor]) -> SparseMoE:
    moe = SparseMoE(s.hidden, s.inter, s.experts, s.top_k, ctx, torch.float32)
    moe.gate.data.copy_(w["gate"])
    _load(moe, w, set(moe.set_placement(static_placement(s.experts, s.redundant, s.ep))))
    return moe


def _timed(moe: SparseMoE, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    dist.barrier()
    start = time.perf_counter()
    out = moe(x)
    return time.perf_counter() - start, out


def _figures(moe: SparseMoE, times: list[float]) -> dict[str, Any]:
    rows = [torch.zeros(1, dtype=torch.int64) for _ in range(moe.ctx.ep_size)]
    dist.all_gather(rows, moe.computed.sum().reshape(1))
    per_rank = [int(r.item()) for r in rows]
    return {
        "rows_per_rank": per_rank,
        "imbalance_by_rank": round(imbalance(per_rank), 3),
        "step_ms": round(statistics.median(times) * 1e3, 2),
        "placement": list(moe.placement.slots),
    }


@torch.no_grad()
def _rank(rank: int, s: EplbSetup, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=s.ep)
    try:
        w = _weights(s)
        ctx = ParallelContext(ep_rank=rank, ep_size=s.ep, ep_group=dist.group.WORLD)
        static, placed = _build(s, ctx, w), _build(s, ctx, w)
        placed(w["x"])  # one step on the static placement counts the load
        load = placed.routed - placed.routed_at_placement
        dist.all_reduce(load)
        placed.routed_at_placement = placed.routed.clone()
        _load(placed, w, set(placed.set_placement(place(load.tolist(), s.redundant, s.ep))))
        # The two placements take turns, so a busy spell of the host hits both alike.
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(s.steps):
            t_static, before = _timed(static, w["x"])
            t_placed, after = _timed(placed, w["x"])
            times[0].append(t_static)
            times[1].append(t_placed)
        figures = {"before": _figures(static, times[0]), "after": _figures(placed, times[1])}
        if rank == 0:
            diff = float((before - after).abs().max())
            results.put({"load": load.tolist(), **figures, "diff": diff})
    finally:
        dist.destroy_process_group()


def _load(moe: SparseMoE, w: dict[str, torch.Tensor], slots: set[int]) -> None:
    # A tensor slices like a checkpoint's ``TensorSource``.
    moe.load_fused(cast(TensorSource, w["gate_up"]), "w13", slots)
    moe.load_fused(cast(TensorSource, w["down"]), W2_DOWN, slots)


def measure(s: EplbSetup) -> dict[str, Any]:
    """Run the layer on ``s.ep`` processes; rank 0's figures before and after re-placement."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, s, port, results)) for r in range(s.ep)]
    for p in procs:
        p.start()
    try:
        out: dict[str, Any] = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return out


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(EplbOptions, args))


def benchmark(args: EplbOptions) -> int:
    """Step time and imbalance before and after rebalancing; the report written."""
    setup = EplbSetup(
        hidden=args.hidden,
        inter=args.inter,
        tokens=args.tokens,
        redundant=args.redundant,
        bias=args.bias,
        steps=args.steps,
    )
    result = measure(setup)
    report = {
        "command": f"pdserve bench eplb --hidden {args.hidden} --inter {args.inter} "
        f"--tokens {args.tokens} --redundant {args.redundant} --bias {args.bias} "
        f"--steps {args.steps}",
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "setup": asdict(setup),
        **result,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        write_json(Path(args.out), report)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=count, default=1024)
    p.add_argument("--inter", type=count, default=2048)
    p.add_argument("--tokens", type=count, default=256, help="tokens per step")
    p.add_argument("--redundant", type=int, default=2, help="redundant expert slots")
    p.add_argument("--bias", type=float, default=4.0, help="router bias of the hot experts")
    p.add_argument("--steps", type=count, default=10, help="timed forwards per phase")
    p.add_argument("--out", default="bench/out/eplb.json")
    p.set_defaults(func=run)
