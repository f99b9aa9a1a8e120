"""``pdserve bench serve`` end to end against a real local cluster (builtin:tiny):
gRPC and HTTP streaming, the JSON records, the plots, and rank pinning."""

from __future__ import annotations

import json
import os

import pytest
import ray

from pdserve.bench.local import pin_instances
from pdserve.cluster.config import parse_config
from pdserve.cluster.serve import start_controller
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cli import main

CONFIG = """\
model: builtin:tiny
connector: shm
engine: {dtype: float32, max_num_batched_tokens: 128}
regions:
  - name: east
    prefill: {count: 1, min: 1, max: 1, num_cpus_per_rank: 0.5}
    decode: {count: 1, min: 1, max: 1, num_cpus_per_rank: 0.5}
server: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
auth: {api_keys: [bench-key]}
planner: {mode: "off"}
disaggregation: {local_prefill_max_tokens: 8}
"""


@pytest.fixture(scope="module")
def cluster(ray_session):
    controller, endpoints = start_controller(parse_config(CONFIG, "bench.yaml"))
    yield controller, endpoints
    ray.get(controller.stop.remote())
    ray.kill(controller)


COMMON = [
    "--prompt-len-range",
    "16",
    "48",
    "--output-len",
    "6",
    "--warmup",
    "1",
    "--api-key",
    "bench-key",
    "--no-progress",
    "--ttft-slo-ms",
    "5000",
    "--tpot-slo-ms",
    "1000",
]


def test_grpc_sweep_writes_records_summaries_and_plots(cluster, tmp_path):
    _, endpoints = cluster
    target = f"grpc://{endpoints.host}:{endpoints.grpc_port}"
    argv = [
        "bench",
        "serve",
        "--target",
        target,
        "--rate",
        "4",
        "8",
        "--num-requests",
        "4",
        *COMMON,
        "--out",
        str(tmp_path),
        "--name",
        "smoke",
    ]
    assert main(argv) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["command"].startswith(f"pdserve bench serve --target {target} --api-key")
    assert "bench-key" not in json.dumps(result)  # the key is not written out
    assert result["date"] and result["machine"]["cpu_count"]
    assert [run["rate"] for run in result["runs"]] == [4, 8]
    for run in result["runs"]:
        records = run["requests"]
        assert len(records) == 4 and all(r["ok"] for r in records), records
        for r in records:
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            assert r["output_len"] == 6  # ignore_eos: every requested token
            assert len(r["itl_s"]) == 5
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5)
        summary = run["summary"]
        assert summary["num_ok"] == 4 and summary["attainment"] == 1.0
        assert summary["goodput_rps"] == pytest.approx(summary["throughput_rps"])
        assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    for name in ("smoke-latency-cdf.png", "smoke-goodput.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_http_trace_replay_and_auth_errors_are_recorded(cluster, tmp_path):
    _, endpoints = cluster
    target = f"http://{endpoints.host}:{endpoints.http_port}"
    argv = [
        "bench",
        "serve",
        "--target",
        target,
        "--trace",
        "azure-conv",
        "--rate",
        "10",
        "--length-scale",
        "0.05",
        "--max-prompt-len",
        "64",
        "--max-output-len",
        "8",
        "--num-requests",
        "3",
        *COMMON,
        "--out",
        str(tmp_path),
        "--name",
        "http",
    ]
    assert main(argv) == 0
    records = json.loads((tmp_path / "http.json").read_text())["runs"][0]["requests"]
    assert len(records) == 3 and all(r["ok"] for r in records), records
    assert [r["prompt_len"] for r in records] == [19, 20, 44]  # the trace's first, x0.05
    assert all(r["output_len"] == r["max_tokens"] for r in records)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in records)

    grpc_target = f"grpc://{endpoints.host}:{endpoints.grpc_port}"
    bad = [
        "bench",
        "serve",
        "--target",
        grpc_target,
        "--model",
        "builtin:tiny",
        "--rate",
        "10",
        "--num-requests",
        "2",
        "--warmup",
        "0",
        "--api-key",
        "wrong",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--name",
        "denied",
    ]
    assert main(bad) == 0
    denied = json.loads((tmp_path / "denied.json").read_text())["runs"][0]
    assert denied["summary"]["num_failed"] == 2 and denied["summary"]["attainment"] == 0
    assert all(r["error"].startswith("UNAUTHENTICATED") for r in denied["requests"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 1, reason="no usable core")
def test_pinning_sets_the_rank_process_affinity(cluster):
    controller, _ = cluster
    core = min(os.sched_getaffinity(0))
    pinned = pin_instances(controller, {"prefill": (core,), "decode": (core,)})
    assert sorted(p.role for p in pinned) == ["decode", "prefill"]
    for p in pinned:
        assert os.sched_getaffinity(p.pid) == {core}
        assert p.threads > 1
    everywhere = tuple(sorted(os.sched_getaffinity(0)))
    pin_instances(controller, {"prefill": everywhere, "decode": everywhere})
    # a core this process may not use is an error naming it, not a silent skip
    with pytest.raises(InvalidArgumentError, match=r"decode asks for cores \[\d+\]"):
        pin_instances(controller, {"decode": (os.cpu_count() or 1,)})


CLAIM = """
import os, sys
from pdserve.bench.local import claim_cores
from pdserve.core.errors import InvalidArgumentError
every = os.sched_getaffinity(0)
os.sched_setaffinity(0, {min(every)})  # a shell confined to one of its cores
assert claim_cores(every) == every == os.sched_getaffinity(0)
try:
    claim_cores({os.cpu_count()})
except InvalidArgumentError as e:
    print(e)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_named_cores_are_claimed_from_a_confined_parent():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", CLAIM], capture_output=True, text=True, check=True, timeout=60
    )
    assert f"cores: no core [{os.cpu_count()}] on this machine" in out.stdout
