"""TTFT of disaggregated against colocated serving at low load, in one run.

    pdserve bench ttft --model builtin:small

Both setups run on Ray actors the same way, one request at a time:

- colocated: one decode instance that prefills every request itself;
- disaggregated: a prefill instance and a decode instance paired over a
  connector; the first token comes back from the prefill instance while the
  pages stream to the decode instance.

TTFT is measured by this client, from sending the request to receiving its
first token (for colocated, the first token reaches a small subscriber actor
that records when it arrived).

With ``--nodes 2`` (on the CPU) the run has two Ray nodes on this machine
(``bench/nodes.py``) and a second decode instance on the other node, paired with
the same prefill instance: ``disaggregated`` is then the pair on one node, and
``across nodes`` the pair whose pages cross between nodes, over the connector
``--connector`` names (``auto``: shm on one node, the object store across). Each
disaggregated mode also reports the time to the second token, the first one the
decode instance makes: it waits for the pages.

On a GPU the three instances share it (``--gpus-per-instance 0.3``), each with
its own KV pool (``--kv-cache-mib``), and pair over ``cuda_ipc``; ``bench/gpu_check.py``
runs it so on an 8B-shaped model with dummy weights when Ray is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from pdserve.bench.flags import count
from pdserve.bench.nodes import local_nodes
from pdserve.bench.report import write_json
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.messages import PrefillRequest, ReserveRequest, TokenBatch
from pdserve.core.options import options_from
from pdserve.core.sampling_params import SamplingParams

NODE = "pdserve/bench-node"  # the label of the second node (--nodes 2)
ACROSS = "across nodes"  # the mode whose pair spans two nodes

if TYPE_CHECKING:
    from pdserve.cluster.instances import Instance
    from pdserve.core.model_config import ModelConfig


@dataclass(frozen=True)
class TtftOptions:
    """``pdserve bench ttft``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model of every instance
    prompt_len: int = 512  # tokens of each prompt
    output_len: int = 4  # tokens of each output
    requests: int = 10  # requests timed per mode
    connector: str = "shm"  # the KV connector (auto: cuda_ipc on a GPU, shm on a CPU)
    dtype: str = "float32"  # the instances' dtype
    load_format: str = "safetensors"  # or dummy: random weights
    gpus_per_instance: float = 0.0  # each instance's share of the one GPU (0: the CPU)
    kv_cache_mib: int | None = None  # each instance's KV pool (None: the engine's default)
    nodes: int = 1  # 2: a second decode instance on a second Ray node
    out: str = "bench/out/ttft.json"  # the result file ("": none)


class FirstTokenClock:
    """Subscriber actor (async): records when each request's first token arrives."""

    def __init__(self) -> None:
        import asyncio

        self.first: dict[str, float] = {}
        self._first: dict[str, asyncio.Event] = {}
        self._done: dict[str, asyncio.Event] = {}

    def _event(self, table: dict[str, Any], rid: str) -> Any:
        import asyncio

        return table.setdefault(rid, asyncio.Event())

    async def deliver(self, batch: TokenBatch) -> None:
        now = time.monotonic()
        for update in batch.updates:
            if update.new_token_ids and update.request_id not in self.first:
                self.first[update.request_id] = now
                self._event(self._first, update.request_id).set()
            if update.finished:
                self._event(self._done, update.request_id).set()

    async def wait_first(self, rid: str) -> float:
        await self._event(self._first, rid).wait()
        return self.first[rid]

    async def wait_done(self, rid: str) -> None:
        await self._event(self._done, rid).wait()


def _prompt(i: int, length: int, vocab: int) -> list[int]:
    return [(i * 7919 + j * 31) % (vocab - 3) + 3 for j in range(length)]


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(TtftOptions, args))


def benchmark(args: TtftOptions) -> int:
    """Each mode's TTFT, one request at a time; the report printed and written."""
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model

    device = _device(args.gpus_per_instance)
    if args.nodes == 2 and args.gpus_per_instance:
        raise InvalidArgumentError("nodes", "two nodes run on the CPU (no --gpus-per-instance)")
    if args.nodes == 2 and args.connector == "shm":  # it would reach the other node only
        # because both share this machine's memory, which nodes of a cluster do not
        raise InvalidArgumentError(
            "connector", "shm reaches only its own node: with --nodes 2 give auto or p2p"
        )
    with contextlib.ExitStack() as stack:
        if args.nodes == 2:  # this node (the head) and another
            stack.enter_context(local_nodes([(1, {NODE: "other"})], 3, {NODE: "head"}))
        elif not ray.is_initialized():
            gpus = 1 if args.gpus_per_instance else None  # None: as many as Ray detects
            ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
        model = ModelConfig.from_dir(resolve_model(args.model))
        colocated, prefill, decodes = _start_instances(args, model)
        # Ray types ``.remote()`` as a handle or the class itself (whose methods have
        # no ``remote``), so actor handles are held as Any.
        clock: Any = ray.remote(FirstTokenClock).options(num_cpus=0).remote()
        ttft, second = _measure(args, model.vocab_size, colocated, prefill, decodes, clock)
        for instance in (prefill, *decodes.values(), colocated):
            instance.shutdown()
    rows = {mode: round(statistics.median(v) * 1e3, 1) for mode, v in ttft.items()}
    report = {
        "command": " ".join(["pdserve bench ttft", *_flags(args)]),
        "device": device,
        "dtype": args.dtype,
        "median_ttft_ms": rows,
        "overhead": round(rows["disaggregated"] / rows["colocated"] - 1, 3),
        "median_second_token_ms": {
            m: round(statistics.median(v) * 1e3, 1) for m, v in second.items()
        },
    }
    if args.nodes == 2:
        report["across_nodes_overhead"] = round(rows[ACROSS] / rows["disaggregated"] - 1, 3)
    print(json.dumps(report))
    if args.out:
        write_json(Path(args.out), report)
    return 0


def _start_instances(
    args: TtftOptions, model: ModelConfig
) -> tuple[Instance, Instance, dict[str, Instance]]:
    """The colocated decode instance, a prefill instance, and the decode instances it is
    paired with, by mode (with ``--nodes 2``, the second on the other node)."""
    from pdserve.cluster.instances import pair, start_instance
    from pdserve.core.config import DisaggregationConfig
    from pdserve.llm import build_engine_config
    from pdserve.parallel.instance import RankResources

    memory = {"kv_cache_memory_bytes": args.kv_cache_mib << 20} if args.kv_cache_mib else {}
    engine = build_engine_config(
        args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_batched_tokens=args.prompt_len,
        **memory,
    )
    here = {NODE: "head"} if args.nodes == 2 else None  # the head's three, then the other
    res = RankResources(num_cpus=1, num_gpus=args.gpus_per_instance, labels=here)
    remote = DisaggregationConfig(local_prefill_max_tokens=0, local_prefill_cached_fraction=1.0)
    local = DisaggregationConfig(local_prefill_max_tokens=10**9)
    colocated = start_instance("decode", model, engine, args.connector, res, local)
    prefill = start_instance("prefill", model, engine, args.connector, res, remote)
    decodes = {
        "disaggregated": start_instance("decode", model, engine, args.connector, res, remote)
    }
    if args.nodes == 2:
        there = dataclasses.replace(res, labels={NODE: "other"})
        decodes[ACROSS] = start_instance("decode", model, engine, args.connector, there, remote)
    for decode in decodes.values():
        pair(prefill, decode)
    return colocated, prefill, decodes


def _measure(
    args: TtftOptions,
    vocab_size: int,
    colocated: Instance,
    prefill: Instance,
    decodes: dict[str, Instance],
    clock: Any,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds to the first token of each request, per mode, one request at a time; and
    to the second token (the decode instance's first), per disaggregated mode."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {"colocated": [], **{m: [] for m in decodes}}
    second: dict[str, list[float]] = {m: [] for m in decodes}
    for i in range(args.requests + 1):  # request 0 warms every path up
        for k, mode in enumerate(ttft):
            # a prompt of its own per mode: the disaggregated modes share one prefill
            # instance, whose prefix cache would serve a later mode's repeat of the prompt
            prompt = _prompt(i * len(ttft) + k, args.prompt_len, vocab_size)
            rid = f"{mode}-{i}"
            start = time.monotonic()
            if mode == "colocated":
                first = _first_token_colocated(colocated, clock, rid, prompt, params)
            else:
                first = _first_token_disaggregated(
                    prefill, decodes[mode], clock, rid, prompt, params
                )
                if i > 0:  # the decode instance's first token reaches the clock
                    second[mode].append(ray.get(clock.wait_first.remote(rid)) - start)
            if i > 0:
                ttft[mode].append(first - start)
            ray.get(clock.wait_done.remote(rid), timeout=120)
    return ttft, second


def _first_token_colocated(
    colocated: Instance, clock: Any, rid: str, prompt: list[int], params: SamplingParams
) -> float:
    """The instance prefills the request itself; ``clock`` records when the first token came."""
    ray.get(colocated.leader.reserve.remote(ReserveRequest(rid, prompt, params), None, clock))
    first: float = ray.get(clock.wait_first.remote(rid))
    return first


def _first_token_disaggregated(
    prefill: Instance,
    decode: Instance,
    clock: Any,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
) -> float:
    """Reserve pages on ``decode``, then prefill; the first token is the prefill call's answer."""
    reservation = ray.get(
        decode.leader.reserve.remote(
            ReserveRequest(rid, prompt, params), prefill.instance_id, clock
        )
    )
    ray.get(prefill.leader.prefill.remote(PrefillRequest(rid, prompt, params, reservation)))
    return time.monotonic()


def _device(gpus_per_instance: float) -> str:
    """The device the instances run on: "cpu", or the GPU's name."""
    if not gpus_per_instance:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpus-per-instance: needs a CUDA GPU; this machine has none")
    return torch.cuda.get_device_name(0)


def _flags(args: TtftOptions) -> list[str]:
    """The command line that repeats this run (defaults included)."""
    flags = [
        f"--model {args.model}",
        f"--prompt-len {args.prompt_len}",
        f"--output-len {args.output_len}",
        f"--requests {args.requests}",
        f"--connector {args.connector}",
        f"--dtype {args.dtype}",
        f"--load-format {args.load_format}",
    ]
    if args.gpus_per_instance:
        flags.append(f"--gpus-per-instance {args.gpus_per_instance:g}")
    if args.kv_cache_mib:
        flags.append(f"--kv-cache-mib {args.kv_cache_mib}")
    if args.nodes != 1:
        flags.append(f"--nodes {args.nodes}")
    return flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--prompt-len", type=count, default=512)
    p.add_argument("--output-len", type=count, default=4)
    p.add_argument("--requests", type=count, default=10)
    p.add_argument("--connector", default="shm", help="auto: cuda_ipc on a GPU, shm on a CPU")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-format", default="safetensors", choices=("safetensors", "dummy"))
    p.add_argument(
        "--gpus-per-instance",
        type=_share,
        default=0.0,
        help="each instance's share of the one GPU (0: on the CPU)",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=count,
        default=None,
        help="each instance's KV pool (default: 256 MiB on a CPU, 85%% of "
        "a GPU's free memory, which leaves none for the next instance)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: a second decode instance on a second Ray node started on this machine",
    )
    p.add_argument("--out", default="bench/out/ttft.json")
    p.set_defaults(func=run)


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1 / 3:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1/3 (three instances), got {text}")
    return value
