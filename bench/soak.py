"""``pdserve bench soak``: a local cluster under steady load, client cancels and worker kills.

    pdserve bench soak --minutes 10 [--config deploy/configs/local.yaml] [--out bench/out/soak.json]

Phases, in order:

1. start: the cluster from the config on an embedded Ray instance, as ``pdserve serve``
   does (auth as the config says);
2. reference: the greedy output of every prompt of a small fixed pool, computed once
   through the healthy cluster one prompt at a time, then again all at once (the two
   must agree, or no token check could be trusted);
3. capacity: a closed loop of ``--capacity-concurrency`` clients for
   ``--capacity-seconds``; completed requests per second is the capacity;
4. soak: open-loop Poisson arrivals at ``--load`` x capacity for ``--minutes``, half
   ``Generate`` (streamed), half ``Complete`` (unary), greedy with ``ignore_eos``;
   ``--cancel-fraction`` of them are cancelled by the client (streams before the first
   token, right after it or mid-stream; unary calls after a random delay), and every
   ``--kill-every`` seconds a random prefill or decode rank process gets SIGKILL;
5. drain: every request gets its answer (or its deadline), the cluster is whole and
   idle again, each pool prompt is served once more, then every instance reports the KV
   pages it still holds and runs its idle check.

Every request ends as exactly one outcome (:func:`classify`); the tokens any request
received are checked against its prompt's reference (:func:`check_tokens`). A thread
samples the RSS of every process of the cluster meanwhile (:func:`rss_summary`).

A rank's PID comes from the rank itself (``__ray_call__`` on its control concurrency
group, so it never waits behind the data path): Ray's state API (``list_actors``) needs
the dashboard, which the embedded Ray instance runs without.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import workload as wl
from pdserve.bench.report import header, percentiles, write_json

logger = logging.getLogger(__name__)

UNCLEAR_CODES = ("UNKNOWN", "INTERNAL")  # a failure that does not say what went wrong
CANCEL_PHASES = ("before_first", "after_first", "mid_stream")
OUTCOMES = ("completed", "failed", "cancelled", "lost", "unclear")
MIB = 1 << 20
VOCAB = 256  # prompt token ids are drawn from [3, VOCAB)
# Processes whose memory growth fails the soak; Ray's own (GCS, raylet, agents) are reported.
PDSERVE_PROCESSES = ("driver", "controller", "router", "prefill rank", "decode rank")


# -- what a request saw, and what it means (pure) ------------------------------------------


@dataclass
class Attempt:
    """One request as the client saw it.

    ``cancel_at`` is the phase the client planned to cancel at (None: never);
    ``cancelled`` is set only when the cancel reached the call before its answer, and
    ``tokens_at_cancel`` is how many tokens had arrived then.
    """

    index: int
    kind: str  # "stream" (Generate) or "unary" (Complete)
    prompt: int  # index into the prompt pool
    max_tokens: int
    sent_s: float = 0.0
    cancel_at: str | None = None
    cancel_after: float = 0.0  # seconds (before_first, unary) or tokens (mid_stream)
    cancelled: bool = False
    tokens_at_cancel: int = 0
    first_chunk: int = 0  # tokens in the first chunk of a stream
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    code: str | None = None  # gRPC status name of the error that ended it
    details: str = ""
    e2e_s: float | None = None
    ttft_s: float | None = None


def classify(a: Attempt) -> str:
    """``completed``: a final answer; ``cancelled``: the client cancelled first;
    ``failed``: a gRPC status that says what happened; ``unclear``: UNKNOWN or INTERNAL;
    ``lost``: no final answer by the deadline, or a stream that ended without one."""
    if a.code is None and a.finish_reason:
        return "completed"
    if a.cancelled and a.code in (None, "CANCELLED"):
        return "cancelled"
    if a.code is None or a.code == "DEADLINE_EXCEEDED":
        return "lost"
    return "unclear" if a.code in UNCLEAR_CODES else "failed"


def cancel_phase(a: Attempt) -> str:
    """Where a cancelled request was when the cancel went out (unary calls cannot tell)."""
    if a.kind == "unary":
        return "unary"
    if a.tokens_at_cancel == 0:
        return "before_first"
    return "after_first" if a.tokens_at_cancel <= a.first_chunk else "mid_stream"


def check_tokens(got: Sequence[int], want: Sequence[int], complete: bool) -> tuple[str, int]:
    """("ok" | "missing" | "repeated" | "wrong", index of the first bad token or -1).

    ``want`` is the reference for the request's ``max_tokens``. A complete answer must
    equal it; a partial one (cancelled, failed) must be a prefix of it. At the first
    difference the rest of ``got`` is aligned with ``want``: resuming at an earlier
    reference position is a repeat, at a later one a gap.
    """
    n = min(len(got), len(want))
    i = next((k for k in range(n) if got[k] != want[k]), n)
    if i == len(got) == len(want) or (i == len(got) and not complete):
        return "ok", -1
    if i == len(got):
        return "missing", i
    if i == len(want):
        return "repeated", i  # more tokens than asked for
    best_j, best_m = -1, 0
    for j in range(len(want)):
        m = 0
        while i + m < len(got) and j + m < len(want) and got[i + m] == want[j + m]:
            m += 1
        if m > best_m or (m == best_m and m > 0 and abs(j - i) < abs(best_j - i)):
            best_j, best_m = j, m
    if best_m == 0:
        return "wrong", i
    return ("repeated" if best_j < i else "missing"), i


@dataclass(frozen=True)
class RssSample:
    t_s: float  # seconds since sampling began
    kind: str  # "driver", "router", "prefill rank", "raylet", ...
    pid: int
    rss: int  # bytes


def rss_summary(samples: Sequence[RssSample], baseline_s: float) -> dict[str, dict[str, Any]]:
    """Per process kind: peak RSS (MiB) of one process in the first ``baseline_s`` and over
    the run, their ratio, and how many processes of that kind were seen."""
    by_kind: dict[str, list[RssSample]] = defaultdict(list)
    out: dict[str, dict[str, Any]] = {}
    for s in samples:
        by_kind[s.kind].append(s)
    for kind, rows in sorted(by_kind.items()):
        early = [s.rss for s in rows if s.t_s <= baseline_s]
        first = max(early) / MIB if early else 0.0
        peak = max(s.rss for s in rows) / MIB
        out[kind] = {
            "first_peak_mib": round(first, 1),
            "peak_mib": round(peak, 1),
            "growth": round(peak / first, 3) if first else None,  # None: first seen later
            "processes": len({s.pid for s in rows}),
        }
    return out


def tally(attempts: Sequence[Attempt], references: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Outcome counts (all, per kind, per cancel phase), failure codes and token problems."""
    outcomes: Counter[str] = Counter()
    per_kind: dict[str, Counter[str]] = defaultdict(Counter)
    phases: Counter[str] = Counter()
    codes: dict[str, Counter[str]] = {"failed": Counter(), "unclear": Counter()}
    problems, unfinished = [], []
    for a in attempts:
        outcome = classify(a)
        outcomes[outcome] += 1
        per_kind[a.kind][outcome] += 1
        if outcome == "cancelled":
            phases[cancel_phase(a)] += 1
        if outcome in codes:
            codes[outcome][f"{a.code}: {a.details[:120]}"] += 1
        if outcome in ("lost", "unclear"):
            unfinished.append(_brief(a, outcome))
        want = references[a.prompt][: a.max_tokens]
        check, at = check_tokens(a.tokens, want, outcome == "completed")
        if check != "ok":
            problems.append({**_brief(a, outcome), "check": check, "at": at,
                             "got": a.tokens[max(0, at - 3): at + 5],
                             "want": list(want[max(0, at - 3): at + 5])})  # fmt: skip
    return {
        "sent": len(attempts),
        "completed_ok": outcomes["completed"] - sum(p["outcome"] == "completed" for p in problems),
        "outcomes": {k: outcomes[k] for k in OUTCOMES},
        "per_kind": {k: {o: c[o] for o in OUTCOMES} for k, c in sorted(per_kind.items())},
        "cancel_phases": dict(phases),
        "failure_codes": dict(codes["failed"].most_common(10)),
        "unclear_codes": dict(codes["unclear"].most_common(10)),
        "token_problems": Counter(p["check"] for p in problems),
        "token_problem_requests": problems[:50],  # the first ones, in full
        "lost_or_unclear_requests": unfinished[:50],
    }


def _brief(a: Attempt, outcome: str) -> dict[str, Any]:
    return {"index": a.index, "kind": a.kind, "outcome": outcome, "sent_s": round(a.sent_s, 2),
            "tokens": len(a.tokens), "max_tokens": a.max_tokens, "cancel_at": a.cancel_at,
            "code": a.code, "details": a.details[:200]}  # fmt: skip


def result_table(result: dict[str, Any]) -> str:
    """The soak's figures as a plain-text table (the JSON holds the details)."""
    t, o = result["soak"], result["soak"]["outcomes"]
    rows = [
        ("requests sent", t["sent"], ""),
        ("completed correctly", t["completed_ok"], ""),
        ("failed with a clear status", o["failed"], ", ".join(t["failure_codes"]) or "-"),
        ("cancelled by the client", o["cancelled"],
         ", ".join(f"{k} {v}" for k, v in sorted(t["cancel_phases"].items())) or "-"),
        ("lost (must be 0)", o["lost"], ""),
        ("failed UNKNOWN/INTERNAL (must be 0)", o["unclear"], ", ".join(t["unclear_codes"])),
        ("repeated tokens (must be 0)", t["token_problems"].get("repeated", 0), ""),
        ("missing tokens (must be 0)", t["token_problems"].get("missing", 0), ""),
        ("wrong tokens", t["token_problems"].get("wrong", 0), ""),
        ("workers killed", len(result["kills"]), ""),
        ("KV pages leaked at the end (must be 0)", result["leaks"]["pages"],
         "; ".join(result["leaks"]["not_idle"]) or "idle checks pass"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    lines = [f"capacity {result['capacity']['rps']:.2f} req/s, load {result['rate_rps']:.2f} req/s "
             f"for {result['options']['minutes']:g} min"]  # fmt: skip
    lines += [f"{name:<{width}}  {value:>7}  {note}".rstrip() for name, value, note in rows]
    first = f"first {result['options'].get('rss_baseline_minutes', 2):g} min"
    lines += ["", f"{'peak RSS (MiB)':<22} {first:>11} {'whole run':>10} {'growth':>7}"]
    for kind, r in result["rss"].items():
        note = "" if kind in PDSERVE_PROCESSES else ", Ray's own"
        growth = "-" if r["growth"] is None else f"{r['growth']:.2f}"
        lines.append(f"{kind:<22} {r['first_peak_mib']:>11.1f} {r['peak_mib']:>10.1f} "
                     f"{growth:>7}  ({r['processes']} processes{note})")  # fmt: skip
    return "\n".join(lines)


def plan_attempts(
    arrivals: np.ndarray,
    pool_size: int,
    output_len: tuple[int, int],
    cancel_fraction: float,
    timing: dict[str, float],
    rng: np.random.Generator,
) -> list[tuple[float, Attempt]]:
    """(send offset, request) for each arrival: every other one unary, a random prompt and
    length, and ``cancel_fraction`` of them cancelled at a random phase. ``timing``
    (seconds, from the capacity phase): ``ttft_p50`` bounds the delay of a cancel before
    the first token, ``e2e_p90`` that of a unary cancel."""
    out = []
    for i, at in enumerate(arrivals):
        kind = "stream" if i % 2 == 0 else "unary"
        max_tokens = int(rng.integers(output_len[0], output_len[1] + 1))
        a = Attempt(i, kind, int(rng.integers(pool_size)), max_tokens)
        if rng.random() < cancel_fraction:
            a.cancel_at = "unary" if kind == "unary" else str(rng.choice(CANCEL_PHASES))
            if a.cancel_at == "mid_stream":
                a.cancel_after = float(rng.integers(2, a.max_tokens))
            elif a.cancel_at != "after_first":
                bound = timing["ttft_p50"] if a.cancel_at == "before_first" else timing["e2e_p90"]
                a.cancel_after = float(rng.uniform(0.0, bound))
        out.append((float(at), a))
    return out


# -- the client --------------------------------------------------------------------------------


class SoakClient:
    """Sends soak requests over gRPC (``grpc.aio``, a few channels) and records what each saw."""

    def __init__(
        self, address: str, api_key: str | None, pool: list[tuple[int, ...]], deadline_s: float
    ) -> None:
        import grpc

        from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
        from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

        self._grpc, self._pb = grpc, pb
        self.channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
        self.stubs = [pb_grpc.CompletionStub(c) for c in self.channels]
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.pool = pool
        self.deadline_s = deadline_s

    async def send(self, a: Attempt) -> Attempt:
        pb = self._pb
        request = pb.CompletionRequest(
            prompt_token_ids=pb.TokenIds(ids=self.pool[a.prompt]),
            sampling=pb.SamplingOptions(max_tokens=a.max_tokens, temperature=0, ignore_eos=True),
        )
        stub = self.stubs[a.index % len(self.stubs)]
        method = stub.Generate if a.kind == "stream" else stub.Complete
        call = method(request, metadata=self.metadata, timeout=self.deadline_s)
        timed = a.cancel_at in ("before_first", "unary")
        loop = asyncio.get_running_loop()
        timer = loop.call_later(a.cancel_after, self._cancel, a, call) if timed else None
        start = time.perf_counter()
        try:
            if a.kind == "stream":
                await self._read_stream(a, call, start)
            else:
                reply = await call
                a.tokens, a.finish_reason = list(reply.token_ids), reply.finish_reason
        except self._grpc.aio.AioRpcError as e:
            a.code, a.details = e.code().name, str(e.details() or "")
        except asyncio.CancelledError:  # how grpc.aio ends a call this client cancelled
            if not a.cancelled:
                raise
        finally:
            if timer is not None:
                timer.cancel()
            a.e2e_s = time.perf_counter() - start
        return a

    async def _read_stream(self, a: Attempt, call: Any, start: float) -> None:
        async for chunk in call:
            if not a.tokens and chunk.token_ids:
                a.first_chunk, a.ttft_s = len(chunk.token_ids), time.perf_counter() - start
            a.tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                a.finish_reason = chunk.finish_reason
            elif (a.cancel_at == "after_first" and a.tokens) or (
                a.cancel_at == "mid_stream" and len(a.tokens) >= a.cancel_after
            ):
                self._cancel(a, call)
                return

    @staticmethod
    def _cancel(a: Attempt, call: Any) -> None:
        if not call.done():
            a.tokens_at_cancel = len(a.tokens)
            a.cancelled = bool(call.cancel())

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


# -- the cluster -------------------------------------------------------------------------------


def _whoami(worker: Any) -> tuple[int, str, str]:
    """Runs inside a rank actor: (pid, instance id, role)."""
    return os.getpid(), worker.instance.instance_id, worker.instance.role


def _pid(_actor: Any) -> int:
    return os.getpid()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@dataclass(frozen=True)
class Rank:
    pid: int
    instance_id: str
    role: str


class SoakCluster:
    """A cluster started from its config, as ``pdserve serve`` starts one, plus what the
    soak asks of it: its rank processes, a kill, whether it is whole and idle, leaks."""

    def __init__(self, config: Any) -> None:
        import ray

        from pdserve.cluster.serve import start_controller

        self._ray = ray
        self.config = config
        self.controller, self.endpoints = start_controller(config)
        self.router = ray.get(self.controller.router_handle.remote())
        self.fixed = {
            ray.get(self.controller.__ray_call__.remote(_pid)): "controller",
            ray.get(self.router.__ray_call__.remote(_pid)): "router",
        }

    @property
    def address(self) -> str:
        return f"{self.endpoints.host}:{self.endpoints.grpc_port}"

    def ranks(self) -> list[Rank]:
        """Every instance leader that answers (pid, instance id, role)."""
        ray = self._ray
        leaders = ray.get(self.controller.instance_handles.remote(), timeout=30)
        refs = [
            h.__ray_call__.options(concurrency_group="control").remote(_whoami) for _, h in leaders
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
        out = []
        for ref in ready:
            with contextlib.suppress(Exception):  # it died meanwhile
                out.append(Rank(*ray.get(ref)))
        return out

    def pid_kinds(self) -> dict[int, str]:
        return {**self.fixed, **{r.pid: f"{r.role} rank" for r in self.ranks()}}

    def kill_random(self, rng: np.random.Generator, at_s: float) -> dict[str, Any]:
        """SIGKILL the process of a random prefill or decode rank."""
        ranks = self.ranks()
        if not ranks:
            return {"at_s": round(at_s, 1), "error": "no rank answered"}
        victim = ranks[int(rng.integers(len(ranks)))]
        os.kill(victim.pid, signal.SIGKILL)
        print(f"  {at_s:6.1f} s: killed {victim.instance_id} (pid {victim.pid})", flush=True)
        return {"at_s": round(at_s, 1), **dataclasses.asdict(victim)}

    def status(self) -> Any:
        return self._ray.get(self.controller.status.remote(), timeout=30)

    def settled(self) -> bool:
        """Every region at its targets, nothing starting or unhealthy, every instance idle."""
        s = self.status()
        whole = all(
            r.prefill == r.target_prefill and r.decode == r.target_decode and r.starting == 0
            for r in s.regions
        ) and all(i.healthy for i in s.instances)
        return whole and bool(self._ray.get(self.controller.all_idle.remote(), timeout=60))

    def wait_settled(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.settled():
                    return True
            time.sleep(1.0)
        return False

    def leaks(self) -> dict[str, Any]:
        """KV pages each instance holds (num_blocks - free_blocks), and its idle check."""
        ray = self._ray
        instances, not_idle = [], []
        for role, leader in ray.get(self.controller.instance_handles.remote(), timeout=30):
            stats = ray.get(leader.stats.remote(), timeout=30)
            used = stats.num_blocks - stats.free_blocks
            try:
                ray.get(leader.check_idle.remote(), timeout=30)
            except Exception as e:
                not_idle.append(f"{stats.instance_id}: {_first_line(e)}")
            instances.append({"instance": stats.instance_id, "role": role, "used_pages": used,
                              "num_blocks": stats.num_blocks})  # fmt: skip
        router = ray.get(self.router.stats.remote(), timeout=30)
        return {
            "pages": sum(i["used_pages"] for i in instances),
            "not_idle": not_idle,
            "instances": instances,
            "router_inflight": dict(router.inflight),
            "router": dataclasses.asdict(router),
        }

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.get(self.controller.stop.remote(), timeout=120)
        self._ray.kill(self.controller)


class RssSampler(threading.Thread):
    """Every ``every_s``: the RSS of this driver and every process under it (the embedded
    Ray instance: GCS, raylet, every worker), named by what it runs."""

    def __init__(self, cluster: SoakCluster, every_s: float) -> None:
        super().__init__(name="pdserve-soak-rss", daemon=True)
        self.cluster = cluster
        self.every_s = every_s
        self.samples: list[RssSample] = []
        self.stopped = threading.Event()
        self.start_s = time.monotonic()

    def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a sample missed is no reason to stop sampling
                logger.exception("RSS sample failed")
            if self.stopped.wait(self.every_s):
                return

    def sample(self) -> None:
        import psutil

        kinds = {os.getpid(): "driver", **self.cluster.pid_kinds()}
        me = psutil.Process()
        t = time.monotonic() - self.start_s
        for p in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                kind = kinds.get(p.pid) or _process_kind(p)
                self.samples.append(RssSample(round(t, 1), kind, p.pid, p.memory_info().rss))

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=60)


def _process_kind(p: Any) -> str:
    """A Ray process by its title (``ray::IDLE``), a binary or a Python script by name."""
    name = str(p.name())
    if name == "ray::InstanceWorker":
        return "rank (not serving yet)"  # started since the ranks were last asked
    if name.startswith("python"):
        script = next((a for a in p.cmdline()[1:] if a.endswith(".py")), name)
        return Path(script).stem
    return name.split(".")[0]


# -- the phases --------------------------------------------------------------------------------


async def compute_references(
    client: SoakClient, num_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """(greedy output of each pool prompt, prompts whose concurrent answer differed)."""
    first = [
        await client.send(Attempt(i, "stream", i, num_tokens)) for i in range(len(client.pool))
    ]
    bad = [a for a in first if classify(a) != "completed" or len(a.tokens) != num_tokens]
    if bad:
        from pdserve.core.errors import InstanceFailedError

        raise InstanceFailedError(
            f"the healthy cluster did not answer prompt {bad[0].prompt} for the reference: "
            f"{bad[0].code} {bad[0].details} ({len(bad[0].tokens)} tokens)"
        )
    again = await asyncio.gather(
        *(client.send(Attempt(i, "unary", i, num_tokens)) for i in range(len(client.pool)))
    )
    return [a.tokens for a in first], [
        i for i, a in enumerate(again) if a.tokens != first[i].tokens
    ]


async def closed_loop(
    client: SoakClient, concurrency: int, seconds: float, output_len: tuple[int, int], seed: int
) -> tuple[list[Attempt], float]:
    """(requests, wall seconds) of ``concurrency`` clients sending back to back."""
    rng = np.random.default_rng(seed)
    done: list[Attempt] = []
    start = time.perf_counter()

    async def one_client(w: int) -> None:
        while time.perf_counter() - start < seconds:
            kind = "stream" if (len(done) + w) % 2 == 0 else "unary"
            n = int(rng.integers(output_len[0], output_len[1] + 1))
            done.append(
                await client.send(Attempt(len(done), kind, int(rng.integers(len(client.pool))), n))
            )

    await asyncio.gather(*(one_client(w) for w in range(concurrency)))
    return done, time.perf_counter() - start


async def measure_capacity(
    client: SoakClient, args: argparse.Namespace, references: list[list[int]]
) -> dict[str, Any]:
    """Completed requests per second of the closed loop, its outcomes, and the latencies
    that time the soak's cancels (``timing_s``)."""
    _say(f"capacity: closed loop, {args.capacity_concurrency} clients, {args.capacity_seconds:g} s")
    out_len = (args.output_len[0], args.output_len[1])
    done, wall = await closed_loop(
        client, args.capacity_concurrency, args.capacity_seconds, out_len, args.seed + 1
    )
    t = tally(done, references)
    streams = [a.ttft_s for a in done if a.kind == "stream" and a.ttft_s is not None]
    timing = {
        "ttft_p50": percentiles(streams).get("p50", 0.5),
        "e2e_p90": percentiles([a.e2e_s or 0.0 for a in done]).get("p90", 2.0),
    }
    return {"rps": t["completed_ok"] / wall, "wall_s": wall, **t["outcomes"],
            "token_problems": t["token_problems"], "timing_s": timing}  # fmt: skip


async def open_loop(
    client: SoakClient,
    cluster: SoakCluster,
    planned: list[tuple[float, Attempt]],
    duration_s: float,
    kill_every_s: float,
    rng: np.random.Generator,
) -> tuple[list[Attempt], list[dict[str, Any]]]:
    """Send each request at its offset, and kill a rank every ``kill_every_s``; wait for all."""
    start = time.perf_counter()
    kills: list[dict[str, Any]] = []

    async def scheduled(at: float, a: Attempt) -> Attempt:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        a.sent_s = time.perf_counter() - start
        return await client.send(a)

    async def killer() -> None:
        n = 1
        while n * kill_every_s < duration_s:
            await asyncio.sleep(max(0.0, start + n * kill_every_s - time.perf_counter()))
            at = time.perf_counter() - start
            kills.append(await asyncio.to_thread(cluster.kill_random, rng, at))
            n += 1

    killing = asyncio.create_task(killer())
    attempts = await asyncio.gather(*(scheduled(at, a) for at, a in planned))
    await killing
    return list(attempts), kills


async def drive(
    cluster: SoakCluster, args: argparse.Namespace, api_key: str | None
) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    lo, hi = args.prompt_len
    pool = [
        wl.synthetic_prompt(int(rng.integers(lo, hi + 1)), VOCAB, rng) for _ in range(args.pool)
    ]
    out_len = tuple(args.output_len)
    client = SoakClient(cluster.address, api_key, pool, args.deadline)
    try:
        _say(f"reference: greedy output of {args.pool} prompts, {out_len[1]} tokens each")
        references, unstable = await compute_references(client, out_len[1])
        capacity = await measure_capacity(client, args, references)
        rate = args.load * capacity["rps"]
        duration = args.minutes * 60
        _say(f"soak: {rate:.2f} req/s ({args.load:.0%} of {capacity['rps']:.2f}) for {duration:g} s, "
             f"a kill every {args.kill_every:g} s")  # fmt: skip
        arrivals = wl.arrival_times("poisson", rate, duration_s=duration, seed=args.seed + 2)
        planned = plan_attempts(
            arrivals, len(pool), out_len, args.cancel_fraction, capacity["timing_s"], rng
        )
        attempts, kills = await open_loop(client, cluster, planned, duration, args.kill_every, rng)
        _say("drain: waiting for the cluster to be whole and idle")
        settled = await asyncio.to_thread(cluster.wait_settled, args.settle_timeout)
        after = await asyncio.gather(
            *(client.send(Attempt(i, "stream", i, out_len[1])) for i in range(len(pool)))
        )
        after_ok = sum(a.tokens == references[a.prompt] for a in after)
        settled = settled and await asyncio.to_thread(cluster.wait_settled, args.settle_timeout)
    finally:
        await client.close()
    return {
        "capacity": capacity,
        "rate_rps": rate,
        "reference": {"prompts": len(pool), "tokens": out_len[1], "unstable_prompts": unstable},
        "soak": tally(attempts, references),
        "kills": kills,
        "settled": settled,
        "after_kills": {"prompts": len(pool), "matching_reference": after_ok},
        "leaks": await asyncio.to_thread(cluster.leaks),
        "events": list(cluster.status().events),
        "requests": [_request_json(a) for a in attempts],
    }


def _request_json(a: Attempt) -> dict[str, Any]:
    row = dataclasses.asdict(a)
    row["tokens"] = len(a.tokens)  # the tokens themselves: in token_problem_requests
    row["outcome"] = classify(a)
    return row


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} soak {text}", flush=True)


# -- the command -------------------------------------------------------------------------------


def verdict(result: dict[str, Any], growth_limit: float) -> list[str]:
    """What the soak found wrong (empty: it passed)."""
    t = result["soak"]
    found = [f"{t['outcomes'][k]} {k} request(s)" for k in ("lost", "unclear") if t["outcomes"][k]]
    found += [f"{n} request(s) with {k} tokens" for k, n in t["token_problems"].items()]
    found += [
        f"{n} request(s) with {k} tokens while measuring capacity"
        for k, n in result["capacity"].get("token_problems", {}).items()
    ]
    leaks = result["leaks"]
    if leaks["pages"] or leaks["not_idle"]:
        found.append(f"{leaks['pages']} KV page(s) leaked; {leaks['not_idle']}")
    if any(leaks.get("router_inflight", {}).values()):
        found.append(f"the router still counts requests in flight: {leaks['router_inflight']}")
    if not result["settled"]:
        found.append("the cluster was not whole and idle at the end")
    if result["reference"]["unstable_prompts"]:
        found.append(f"greedy output differs run to run: {result['reference']['unstable_prompts']}")
    a = result["after_kills"]
    if a["matching_reference"] != a["prompts"]:
        found.append(f"after the kills {a['matching_reference']}/{a['prompts']} prompts match")
    found += [
        f"{kind} RSS grew x{r['growth']:.2f} after the first minutes"
        for kind, r in result["rss"].items()
        if kind in PDSERVE_PROCESSES and (r["growth"] or 0.0) > growth_limit
    ]
    return found


def check_args(args: argparse.Namespace) -> None:
    from pdserve.core.errors import InvalidArgumentError

    lo, hi = args.output_len
    if not 3 <= lo <= hi:
        raise InvalidArgumentError(
            "output-len", f"needs 3 <= LO <= HI (a mid-stream cancel needs 3 tokens), got {lo} {hi}"
        )
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        raise InvalidArgumentError("prompt-len", f"needs 1 <= LO <= HI, got {args.prompt_len}")
    if not args.minutes > 0 or not args.load > 0 or not args.kill_every > 0:
        raise InvalidArgumentError("minutes", "--minutes, --load and --kill-every must be > 0")
    if not 0 <= args.cancel_fraction <= 1 or args.pool < 1 or args.capacity_concurrency < 1:
        raise InvalidArgumentError(
            "cancel-fraction", "must be in [0, 1] (and --pool, --capacity-concurrency >= 1)"
        )


def api_key_for(config: Any) -> str | None:
    """The key a client of this config's cluster sends (None: auth is disabled)."""
    if config.router.auth_disabled:
        return None
    env = [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",") if k.strip()]
    keys = [*config.router.api_keys, *env]
    return keys[0] if keys else None


def run(args: argparse.Namespace) -> int:
    import ray

    from pdserve.bench.serve import command_line
    from pdserve.cluster.config import load_config
    from pdserve.cluster.serve import connect

    check_args(args)
    config = load_config(args.config)
    if args.any_port:
        router = dataclasses.replace(config.router, grpc_port=0, http_port=0)
        config = dataclasses.replace(config, router=router)
    started_ray = not ray.is_initialized()
    _say(f"starting the cluster of {args.config}")
    connect("local", config.ray_num_cpus or DEFAULT_NUM_CPUS)
    cluster: SoakCluster | None = None
    sampler: RssSampler | None = None
    try:
        cluster = SoakCluster(config)
        sampler = RssSampler(cluster, args.rss_every)
        sampler.start()
        result = asyncio.run(drive(cluster, args, api_key_for(config)))
        sampler.stop()
        result["rss"] = rss_summary(sampler.samples, args.rss_baseline_minutes * 60)
        result["rss_samples"] = [dataclasses.astuple(s) for s in sampler.samples]
        result["ray_logs"] = _ray_logs()
    finally:
        if sampler is not None:
            sampler.stop()
        if cluster is not None:
            cluster.stop()
        if started_ray:
            ray.shutdown()
    result["log_errors"] = log_errors(result["ray_logs"])
    result["options"] = {k: v for k, v in vars(args).items() if not callable(v) and k != "prog"}
    found = verdict(result, args.rss_growth_limit)
    result["problems"] = found
    path = write_json(Path(args.out), {**header(command_line(args)), **result})
    print(result_table(result))
    for record in result["log_errors"]:
        print(f"logged: {record.splitlines()[1][:200]}")
    print("PASS" if not found else "FAIL: " + "; ".join(found))
    print(f"wrote {path} (the cluster's logs: {result['ray_logs']})")
    return 0 if not found else 1


DEFAULT_NUM_CPUS = 4  # a config without ray.num_cpus


def log_errors(folder: str | None, limit: int = 20, context: int = 16) -> list[str]:
    """The first ``limit`` ERROR records of the cluster's worker logs, each with the
    ``context`` lines after it (its traceback)."""
    if folder is None:
        return []
    found: list[str] = []
    for path in sorted(Path(folder).glob("worker-*.err")):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if " ERROR " in line and len(found) < limit:
                found.append("\n".join([f"{path.name}:{i + 1}", *lines[i : i + context]]))
    return found


def _ray_logs() -> str | None:
    """The log folder of this driver's Ray session (router, controller and rank logs)."""
    import ray

    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    return f"{node.get_session_dir_path()}/logs" if node is not None else None


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "soak", help="a local cluster at 80%% load with client cancels and worker kills"
    )
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak phase")
    p.add_argument("--config", default="deploy/configs/local.yaml", help="cluster config (YAML)")
    p.add_argument("--out", default="bench/out/soak.json", help="result file (JSON)")
    p.add_argument("--any-port", action="store_true", help="free ports instead of the config's")
    p.add_argument("--load", type=float, default=0.8, help="offered rate, share of capacity")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="requests the client cancels")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between rank kills")
    p.add_argument("--capacity-seconds", type=float, default=40.0)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--pool", type=int, default=16, help="distinct prompts")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 48), metavar=("LO", "HI"))
    p.add_argument("--deadline", type=float, default=120.0,
                   help="seconds; a request with no final answer by then is lost")  # fmt: skip
    p.add_argument("--settle-timeout", type=float, default=180.0,
                   help="seconds the cluster may take to be whole and idle at the end")  # fmt: skip
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--rss-baseline-minutes", type=float, default=2.0)
    p.add_argument("--rss-growth-limit", type=float, default=1.25,
                   help="peak RSS over the run / peak in the baseline minutes allowed")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, prog="pdserve bench soak")
