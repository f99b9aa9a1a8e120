"""A pdserve cluster on the local Ray session, and the gRPC calls the cluster tests make.

:class:`Running` starts a controller (which starts the router and region
``east``'s instances) from :data:`BASE`, filled in with the test's instance
counts and options; :func:`generate` streams one greedy completion over gRPC;
:func:`start_streams` runs several at once on threads; :func:`event_log` is the
controller's event log as text.
"""

from __future__ import annotations

import threading
import time

import grpc
import ray

from pdserve.cluster.config import parse_config
from pdserve.cluster.serve import start_controller
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

BASE = """\
model: {model}
connector: shm
engine: {{dtype: float32, max_num_batched_tokens: {budget}{engine}}}
regions:
  - name: east
    prefill: {{count: {p}, min: {p_min}, max: {p_max}, num_cpus_per_rank: 0.25}}
    decode: {{count: {d}, min: {d_min}, max: {d_max}, num_cpus_per_rank: 0.25}}
    warm_pool: {warm_pool}
slo: {{ttft_ms: {ttft}, tpot_ms: 200}}
server: {{host: "{host}", {server}}}
auth: {{disabled: true}}
planner: {{mode: "{planner}", interval_s: 0.5, cooldown_s: 1, idle_s: 2}}
disaggregation: {{local_prefill_max_tokens: 4, local_prefill_cached_fraction: 1.0}}
router: {{policy: {policy}{router}}}
{extra}
"""


class Running:
    def __init__(
        self,
        p: int = 1,
        d: int = 1,
        planner: str = "off",
        ttft_ms: int = 2000,
        budget: int = 256,
        policy: str = "cost_model",
        extra: str = "",
        router: str = "",  # more router keys, e.g. ", peer_kv_s_per_token: 0"
        model: str = "builtin:tiny",
        engine: str = "",  # more engine keys, e.g. ", lora_adapters: {a: /path}"
        bounds: tuple[int, int, int, int] = (1, 3, 1, 3),  # prefill min, max, decode min, max
        warm_pool: int = 0,
        server: str = "grpc_port: 0, http_port: 0",
        host: str = "127.0.0.1",
    ) -> None:
        text = BASE.format(
            p=p,
            d=d,
            planner=planner,
            ttft=ttft_ms,
            budget=budget,
            policy=policy,
            extra=extra,
            router=router,
            model=model,
            engine=engine,
            p_min=bounds[0],
            p_max=bounds[1],
            d_min=bounds[2],
            d_max=bounds[3],
            warm_pool=warm_pool,
            server=server,
            host=host,
        )
        self.config = parse_config(text, "test.yaml")
        self.controller, self.endpoints = start_controller(self.config)
        self.stub = pb_grpc.CompletionStub(grpc.insecure_channel(self.endpoints.grpc_address))

    def status(self):
        return ray.get(self.controller.status.remote())

    def router_stats(self):
        return ray.get(ray.get(self.controller.router_handle.remote()).stats.remote())

    def decode_stats(self):
        return [ray.get(h.stats.remote()) for h in self.leaders("decode")]

    def leaders(self, role: str):
        return [h for (r, h) in ray.get(self.controller.instance_handles.remote()) if r == role]

    def wait(self, check, timeout_s: float = 90.0, what="") -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, (
                f"timed out waiting for {what() if callable(what) else what or check}"
            )
            time.sleep(0.2)

    def assert_idle(self) -> None:
        self.wait(lambda: ray.get(self.controller.all_idle.remote()), timeout_s=20)

    def stop(self) -> None:
        ray.get(self.controller.stop.remote())
        ray.kill(self.controller)


def generate(
    stub,
    prompt: str | list[int],
    max_tokens: int,
    progress: list[int] | None = None,
    region: str = "",
) -> list[int]:
    if isinstance(prompt, str):
        request = pb.CompletionRequest(prompt=prompt, region=region)
    else:
        request = pb.CompletionRequest(prompt_token_ids=pb.TokenIds(ids=prompt), region=region)
    request.sampling.CopyFrom(
        pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    tokens: list[int] = []
    for chunk in stub.Generate(request, timeout=120):
        tokens.extend(chunk.token_ids)
        if progress is not None:
            progress.append(len(tokens))
    return tokens


def start_streams(c: Running, prompts: list, n: int, progress: list[int] | None = None):
    """Start one thread per prompt streaming ``n`` tokens.

    Returns (errors, threads, results by prompt index); ``progress`` gets each
    stream's token count after every chunk.
    """
    results: dict[int, list[int]] = {}
    errors: list[str] = []

    def run(i: int, prompt) -> None:
        try:
            results[i] = generate(c.stub, prompt, n, progress)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return errors, threads, results


def event_log(c: Running) -> str:
    """The controller's event log, one event a line."""
    return "\n".join(c.status().events)
