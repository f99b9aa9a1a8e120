"""``pdserve bench peer``: the serving benchmark against Hugging Face ``transformers``.

    pdserve bench peer --model builtin:small --rate 0.5 1 2

The same workload (Poisson arrivals, same lengths and seed), the same
arithmetic (:mod:`pdserve.bench.report`), on the same cores; the two servers
take turns at each rate (both stay up, the idle one waiting), so a change in
the machine's background load between rates hits both:

- ``transformers``: its continuous-batching manager
  (``model.init_continuous_batching``, streaming per-request results) in this
  process, float32, greedy, with as many torch threads as cores; the load
  generator feeds it directly, so there is no network hop;
- ``pdserve``: a local cluster (``--pdserve-mode``: ``colocated``, one decode
  instance that prefills itself, on every core; or ``disaggregated``, one
  prefill and one decode instance, one core each) driven over gRPC.

Both use the per-step token budget ``--max-num-batched-tokens`` and a KV pool
of the same size. Needs ``transformers`` (the ``test`` extra) with continuous
batching (5.x).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.bench.flags import file_stem
from pdserve.bench.headline import (
    MODES,
    ClusterSetup,
    add_cores_flag,
    check_cores,
    cluster_setup,
)
from pdserve.bench.loadgen import Client, OnChunk, RequestFailed
from pdserve.bench.local import local_cluster
from pdserve.bench.report import header
from pdserve.bench.serve import (
    RunFlags,
    RunResult,
    add_load_flags,
    add_workload_flags,
    check_load_flags,
    command_line,
    options_json,
    serve_rates,
    slo_from,
    summary_table,
    with_prompt_seed,
    write_outputs,
)
from pdserve.bench.workload import RequestSpec
from pdserve.core.errors import UnsupportedError
from pdserve.core.options import options_from

KV_TOKENS = 16384  # pdserve's default CPU pool (256 MiB) holds this many tokens of builtin:small
PAGE_SIZE = 64


@dataclass(frozen=True)
class PeerOptions:
    """``pdserve bench peer``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model both servers serve
    rate: list[float] | None = None  # request rates (None: 0.5 1 2, or 0.5 1 with quick)
    pdserve_mode: str = "colocated"  # pdserve's setup: one of MODES
    cores: list[int] = field(default_factory=list)  # the cores both servers get
    connector: str = "shm"  # pdserve's KV connector (disaggregated)
    max_num_batched_tokens: int = 256  # per-step token budget of both servers
    prefill_max_num_batched_tokens: int = 2048  # pdserve's prefill instance's budget
    quick: bool = False  # rates 0.5 and 1, 4 requests each
    run: RunFlags = field(default_factory=RunFlags)  # the workload and load flags
    out: str = "bench/out/peer"  # output folder
    name: str = "peer"  # output file stem
    target: None = None  # (recorded as bench serve's: the servers are local)
    api_key: None = None  # (recorded as bench serve's: no key)
    prog: str = "pdserve bench peer"  # the command, for the record

    @property
    def setup(self) -> ClusterSetup:
        return ClusterSetup.of(self)


class TransformersClient:
    """A client whose server is ``transformers``' continuous batching in this process."""

    def __init__(self, model_path: str, budget: int, threads: int) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        if not hasattr(self.model, "init_continuous_batching"):
            raise UnsupportedError(
                f"transformers {transformers.__version__} has no continuous batching; "
                "install transformers>=5 (pip install -e '.[test]')"
            )
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16)
        batching = ContinuousBatchingConfig(
            page_size=PAGE_SIZE, num_blocks=KV_TOKENS // PAGE_SIZE, max_batch_tokens=budget
        )
        self.manager = self.model.init_continuous_batching(
            generation_config=config, continuous_batching_config=batching
        )
        self.manager.start()
        self.version = transformers.__version__
        self._ids = itertools.count()

    async def generate(self, spec: RequestSpec, on_chunk: OnChunk) -> int | None:
        if spec.prompt_token_ids is None:
            raise RequestFailed("the transformers peer takes token-id prompts only")
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        seen = 0

        def on_result(result: Any) -> None:  # on the event loop (call_soon_threadsafe)
            nonlocal seen
            n = len(result.generated_tokens)
            if n > seen:
                on_chunk(n - seen)
                seen = n
            if result.is_finished() and not done.done():
                if result.error is not None:
                    done.set_exception(RequestFailed(str(result.error)))
                else:
                    done.set_result(n)

        rid = f"bench-{next(self._ids)}"
        self.manager.register_result_handler(rid, on_result)
        self.manager.add_request(
            list(spec.prompt_token_ids),
            request_id=rid,
            max_new_tokens=spec.max_tokens,
            streaming=True,
            eos_token_id=-1,
        )
        return await done

    async def close(self) -> None:
        """Kept running across rates; :meth:`stop` ends it."""

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=60)


def _apply_defaults(args: PeerOptions) -> PeerOptions:
    """The rates and request count that ``--quick`` or nothing at all asks for, and the
    prompts' seed (both servers get the same prompts)."""
    flags = args.run
    if args.quick:
        args = replace(args, rate=args.rate or [0.5, 1.0])
        flags = replace(flags, num_requests=flags.num_requests or 4, warmup=min(flags.warmup, 1))
    if flags.num_requests is None and flags.duration is None:
        flags = replace(flags, num_requests=40)
    return replace(args, rate=args.rate or [0.5, 1.0, 2.0], run=with_prompt_seed(flags))


def run(args: argparse.Namespace) -> int:
    return peer_bench(_apply_defaults(options_from(PeerOptions, args)))


def peer_bench(args: PeerOptions) -> int:
    """Both servers at each rate in turn; the side-by-side report written and printed."""
    from pdserve.models.builtin import resolve_model

    check_cores(args.cores, [args.pdserve_mode])
    check_load_flags(args.run)
    path = str(resolve_model(args.model))
    cores = tuple(args.cores)

    peer = TransformersClient(path, args.max_num_batched_tokens, len(cores))

    async def make_peer() -> TransformersClient:
        return peer

    label = f"pdserve {args.pdserve_mode}"
    series: dict[str, list[RunResult]] = {"transformers": [], label: []}
    config, pins = cluster_setup(args.pdserve_mode, args.setup)
    saved = os.sched_getaffinity(0)
    # this process is the peer's server: same cores (the Ray processes it starts inherit
    # them; the pdserve ranks are then pinned as the setup says)
    os.sched_setaffinity(0, set(cores))
    try:
        with local_cluster(config, len(cores), pins) as (endpoints, pinned):
            target = f"grpc://{endpoints.grpc_address}"
            servers: list[tuple[str, str | Callable[[], Awaitable[Client]]]] = [
                ("transformers", make_peer),
                (label, target),
            ]
            for i, rate in enumerate(args.rate or ()):  # interleaved: drifting load hits both
                for name, server in servers if i % 2 == 0 else servers[::-1]:
                    series[name] += serve_rates(args.run, server, [rate], name, first_run=i)
    finally:
        peer.stop()
        os.sched_setaffinity(0, saved)
    payload = _payload(args, peer.version, [vars(p) for p in pinned], series)
    paths = write_outputs(Path(args.out), args.name, payload, series, slo_from(args.run))
    print(summary_table([(f"{n} {r.rate:g}/s", r) for n, runs in series.items() for r in runs]))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _payload(
    args: PeerOptions,
    peer_version: str,
    pinning: list[dict[str, Any]],
    series: dict[str, list[RunResult]],
) -> dict[str, Any]:
    """The JSON report: the command, both servers, the side-by-side table and every run."""
    return {
        **header(command_line(args.prog, args)),
        "quick": args.quick,
        "options": options_json(args),
        "peer": {
            "name": "transformers",
            "version": peer_version,
            "server": "ContinuousBatchingManager, in-process",
        },
        "pdserve": {"mode": args.pdserve_mode, "pinning": pinning},
        "side_by_side": side_by_side(series),
        "runs": {name: [r.to_json() for r in runs] for name, runs in series.items()},
    }


def side_by_side(series: dict[str, list[RunResult]]) -> list[dict[str, Any]]:
    """Per rate: throughput and latency of each server."""
    rows = []
    for rate in sorted({r.rate for runs in series.values() for r in runs if r.rate is not None}):
        row: dict[str, Any] = {"rate": rate}
        for name, runs in series.items():
            s = next(r.summary for r in runs if r.rate == rate)
            row[name] = {
                "output_tok_s": round(s["output_tok_s"], 2),
                "throughput_rps": round(s["throughput_rps"], 3),
                "ttft_p50_ms": s["ttft_ms"].get("p50"),
                "ttft_p99_ms": s["ttft_ms"].get("p99"),
                "tpot_p50_ms": s["tpot_ms"].get("p50"),
                "tpot_p99_ms": s["tpot_ms"].get("p99"),
                "e2e_p50_ms": s["e2e_ms"].get("p50"),
                "attainment": round(s["attainment"], 4),
                "goodput_rps": round(s["goodput_rps"], 4),
                "num_failed": s["num_failed"],
            }
        rows.append(row)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument(
        "--rate", type=float, nargs="+", default=None, help="request rates (default 0.5 1 2)"
    )
    p.add_argument("--pdserve-mode", choices=MODES, default="colocated")
    add_cores_flag(p, "cores both servers get")
    p.add_argument("--connector", default="shm")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="per-step token budget of both servers",
    )
    p.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of pdserve's prefill instance (--pdserve-mode disaggregated)",
    )
    p.add_argument("--quick", action="store_true", help="rates 0.5 and 1, 4 requests each")
    add_workload_flags(p, prompt_len=256, output_len=64)
    add_load_flags(p)
    p.set_defaults(prompt_len_range=[128, 512], ttft_slo_ms=3000.0, tpot_slo_ms=100.0)
    p.add_argument("--out", default="bench/out/peer")
    p.add_argument("--name", type=file_stem, default="peer")
    p.set_defaults(func=run, prog="pdserve bench peer", target=None, api_key=None)
