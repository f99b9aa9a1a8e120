"""The soak's hands on the cluster: a gRPC client that sends and cancels, the cluster
it started (ranks by PID, kills, settling, leaked pages), and an RSS sampler.

A rank's PID comes from the rank itself (``__ray_call__`` on its control concurrency
group, so it never waits behind the data path): Ray's state API (``list_actors``) needs
the dashboard, which the embedded Ray instance runs without.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.soak_outcomes import Attempt, RssSample

logger = logging.getLogger(__name__)


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


def _whoami(actor: Any) -> tuple[int, str, str]:
    """Runs inside a rank actor: (pid, instance id, role)."""
    return os.getpid(), actor.worker.instance.instance_id, actor.worker.instance.role


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
        return self.endpoints.grpc_address

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
            instances.append(
                {
                    "instance": stats.instance_id,
                    "role": role,
                    "used_pages": used,
                    "num_blocks": stats.num_blocks,
                }
            )
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
    if name == "ray::InstanceActor":
        return "rank (not serving yet)"  # started since the ranks were last asked
    if name.startswith("python"):
        script = next((a for a in p.cmdline()[1:] if a.endswith(".py")), name)
        return Path(script).stem
    return name.split(".")[0]
