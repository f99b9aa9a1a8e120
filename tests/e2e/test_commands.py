"""The cluster commands as a user runs them: serve, status, scale, and a Ray job."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from pdserve.deploy.cluster_cli import example_config
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_AUTH_MODE": "token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_with_ports(folder: Path, node_labels: str | None = None) -> tuple[Path, int]:
    """The local example on free ports; ``node_labels``: YAML mapping every region requires,
    REGION in it standing for the region's name."""
    grpc_port, http_port = free_port(), free_port()
    text = example_config("local.yaml").read_text()
    if node_labels is not None:
        text = re.sub(
            r"(\n  - name: (\w+)\n    latency_ms: .*\n)",
            lambda m: f"{m.group(1)}    node_labels: {node_labels.replace('REGION', m.group(2))}\n",
            text,
        )
        assert text.count("node_labels") == 2
    text = text.replace(
        "grpc_port: 50051, http_port: 8000", f"grpc_port: {grpc_port}, http_port: {http_port}"
    )
    path = folder / "cluster.yaml"
    path.write_text(text)
    return path, grpc_port


def answer(grpc_port: int, timeout_s: float = 120.0) -> list[int]:
    stub = pb_grpc.CompletionStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = stub.Complete(
                pb.CompletionRequest(prompt="hello", sampling=pb.SamplingOptions(max_tokens=5)),
                timeout=30,
            )
            return list(r.token_ids)
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def pdserve(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "pdserve"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or ENV,
    )


def stop(proc: subprocess.Popen[str], sig: int, timeout_s: float = 120) -> str:
    """Send ``sig`` to a serving command; what it printed after, once it exits. A stop takes
    ~3 s on a quiet machine; one took over 60 s once on a loaded 2-core CI machine, so the
    bound is 120 s, and a stop past it fails with what the command printed."""
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    raise AssertionError(f"no exit {timeout_s:.0f} s after {sig!r}; it printed:\n{out[-3000:]}")


def one_line_error(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The error a failed command printed: one line, exit status 2, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"pdserve {command}")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_serve_status_scale_and_stop(tmp_path) -> None:
    config, grpc_port = config_with_ports(tmp_path)
    proc = subprocess.Popen(
        [str(BIN / "pdserve"), "serve", "--config", str(config), "--ray-address", "local"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**ENV, "PDSERVE_API_KEYS": "key-that-auth-disabled-ignores"},
    )
    try:
        lines, address = [], None
        deadline = time.monotonic() + 180
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "pdserve serve exited: " + "".join(lines)
            lines.append(line)
            if m := re.match(r"ray\s+(\S+)", line):
                address = m.group(1)
        text = "".join(lines)
        assert (
            f"gRPC      127.0.0.1:{grpc_port}" in text
            and "/metrics" in text
            and "/dashboard" in text
        )
        assert "auth.disabled is true: the keys in $PDSERVE_API_KEYS are ignored" in text
        assert len(answer(grpc_port)) == 5
        status = pdserve("status", "--ray-address", address)
        assert status.returncode == 0, status.stderr
        assert re.search(r"east\s+1:1", status.stdout) and "decode" in status.stdout
        # Nothing exported by hand: pdserve finds and sends the cluster's token itself.
        plain = {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}
        status = pdserve("status", "--ray-address", address, env=plain)
        assert status.returncode == 0, status.stderr
        assert re.search(r"decode\s+healthy", status.stdout)
        again = pdserve("serve", "--config", str(config), "--ray-address", address)
        assert "a pdserve cluster is already running on the Ray cluster at" in one_line_error(
            again, "serve"
        )
        scaled = pdserve(
            "scale", "--region", "west", "--decode", "2", "--ray-address", address, timeout=180
        )
        assert scaled.returncode == 0 and "west: 1 prefill, 2 decode" in scaled.stdout, (
            scaled.stderr
        )
        bad = pdserve("scale", "--region", "north", "--decode", "2", "--ray-address", address)
        assert bad.returncode == 2 and "region: unknown region 'north'" in bad.stderr
        assert len(answer(grpc_port)) == 5
    finally:
        out = stop(proc, signal.SIGINT)
    assert proc.returncode == 0 and "pdserve: stopping" in out


def test_demo_streams_then_serves_until_sigterm_and_stops_cleanly(tmp_path) -> None:
    config, _ = config_with_ports(tmp_path)
    proc = subprocess.Popen(
        [str(BIN / "pdserve"), "demo", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while not any("serving; Ctrl-C to stop" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "pdserve demo exited: " + "".join(lines)
            lines.append(line)
        assert sum("TTFT" in line for line in lines) == 4  # each prompt streamed
    finally:
        out = stop(proc, signal.SIGTERM)
    # pdserve stops its cluster itself: no stack lines from Ray's crash handler
    assert proc.returncode == 0 and "pdserve demo: stopping" in out, out[-3000:]
    assert "Traceback" not in out and "SIGTERM received" not in out, out[-3000:]


def test_bad_config_names_the_line(tmp_path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        example_config("local.yaml")
        .read_text()
        .replace("count: 1, min: 1, max: 2", "count: 3, min: 1, max: 2", 1)
    )
    result = pdserve("serve", "--config", str(config), "--ray-address", "local")
    assert result.returncode == 2
    assert re.search(
        r"bad\.yaml:\d+: regions\[0\]\.prefill\.count: must be within \[min=1, max=2\]",
        result.stderr,
    )


def ray_start(*flags: str) -> None:
    started = subprocess.run(
        [str(BIN / "ray"), "start", *flags, "--disable-usage-stats"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert started.returncode == 0, started.stderr[-2000:]


@dataclass(frozen=True)
class RayNodes:
    dashboard: str  # the Jobs API and state API address
    gcs: str  # what `pdserve status/scale --ray-address` take


@pytest.fixture
def ray_nodes():
    """A Ray cluster of three nodes started with `ray start` as on three machines: a head with
    no CPU (the job's driver, controller and router need none) and two worker nodes of two
    CPUs, one labelled for each region. Torn down by killing exactly their processes."""
    temp = Path(f"/tmp/pdserve-test-head-{os.getpid()}")
    # Ports of their own: the test session's Ray may hold the defaults (agent: 52365).
    gcs, dashboard = free_port(), free_port()
    try:
        ray_start(
            "--head",
            f"--port={gcs}",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-agent-listen-port={free_port()}",
            "--num-cpus=0",
            f"--temp-dir={temp}",
        )
        for region in ("east", "west"):
            ray_start(
                f"--address=127.0.0.1:{gcs}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
                "--num-cpus=2",
                f"--labels=pdserve/region={region}",
                f"--temp-dir={temp}",
            )
        yield RayNodes(f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}")
    finally:
        roots = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(temp) in " ".join(p.info["cmdline"] or [])
        ]
        doomed = {p for root in roots for p in [root, *root.children(recursive=True)]}
        for p in doomed:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(list(doomed), timeout=30)
        subprocess.run(["rm", "-rf", str(temp)], check=False)


def ray_cli(*args: str) -> str:
    out = subprocess.run(
        [str(BIN / "ray"), *args], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def job_status(address: str, job_id: str) -> str:
    """The job's status as `ray job status` prints it (a separate process, so the token applies)."""
    out = subprocess.run(
        [str(BIN / "ray"), "job", "status", "--address", address, job_id],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    found = re.search(r"Status for job '[^']+': (\w+)", out.stdout + out.stderr)
    return found.group(1) if found else "UNKNOWN"


def node_regions(address: str) -> dict[str, str | None]:
    """Node id -> its ``pdserve/region`` label, from Ray's state API."""
    nodes = json.loads(ray_cli("list", "nodes", "--address", address, "--format", "json"))
    return {n["node_id"]: n.get("labels", {}).get("pdserve/region") for n in nodes}


def placement(address: str) -> dict[str, set[str | None]]:
    """Instance id -> the region labels of the nodes Ray placed its ranks on, read from Ray's
    state API (placement groups are named pdserve-<instance id>-<suffix>)."""
    label = node_regions(address)
    groups = json.loads(
        ray_cli("list", "placement-groups", "--address", address, "--detail", "--format", "json")
    )
    placed: dict[str, set[str | None]] = {}
    for group in groups:
        if group["state"] == "CREATED" and group["name"].startswith("pdserve-"):
            instance = group["name"].removeprefix("pdserve-").rsplit("-", 1)[0]
            placed[instance] = {label[b["node_id"]] for b in group["bundles"]}
    return placed


def test_ray_job_submit_serves_and_scales_across_the_nodes(tmp_path, ray_nodes) -> None:
    """`pdserve submit` to the head of a three-node cluster: each region's instances run on
    the node labelled for it (as Ray placed them), a scale-up lands on that node too, and the
    dashboard names the node of every instance."""
    config, grpc_port = config_with_ports(tmp_path, "{pdserve/region: REGION}")
    http_port = int(re.search(r"http_port: (\d+)", config.read_text()).group(1))  # type: ignore[union-attr]
    head = ray_nodes.dashboard
    submitted = pdserve(
        "submit", "--address", head, "--config", str(config), "--job-id", "pdserve-test-job"
    )
    assert submitted.returncode == 0, submitted.stderr
    deadline = time.monotonic() + 120
    while (status := job_status(head, "pdserve-test-job")) != "RUNNING":
        assert status == "PENDING" and time.monotonic() < deadline, status
        time.sleep(1.0)
    assert len(answer(grpc_port)) == 5
    placed = placement(head)
    assert len(placed) == 4 and all(
        labels == {instance.split("-")[0]} for instance, labels in placed.items()
    ), placed

    scaled = pdserve("scale", "--region", "east", "--decode", "2", "--ray-address", ray_nodes.gcs)
    assert scaled.returncode == 0, scaled.stderr
    deadline = time.monotonic() + 120
    while len(placed := placement(head)) < 5:
        assert time.monotonic() < deadline, placed
        time.sleep(1.0)
    east_decode = [i for i in placed if i.startswith("east-decode")]
    assert len(east_decode) == 2 and all(placed[i] == {"east"} for i in east_decode), placed
    assert len(answer(grpc_port)) == 5

    # The dashboard's instance table names the node Ray placed each instance on.
    region_of = node_regions(head)
    deadline = time.monotonic() + 30
    while True:  # the new instance's counters come with the next health round
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/dashboard/data") as r:
            rows = json.load(r)["instances"]
        shown = {row["instance"]: region_of.get(row["node_id"]) for row in rows}
        if set(shown) == set(placed) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert shown == {i: next(iter(labels)) for i, labels in placed.items()}, (shown, placed)

    ray_cli("job", "stop", "--address", head, "pdserve-test-job")


def test_status_and_scale_without_a_cluster_say_so_at_once() -> None:
    """No Ray cluster at the address: one line, exit 2, and no new empty Ray instance."""
    nowhere = f"127.0.0.1:{free_port()}"
    config = str(example_config("local.yaml"))
    runs = [
        (("status",), {**ENV, "RAY_ADDRESS": nowhere}, f"no Ray cluster at {nowhere}"),
        (("status", "--ray-address", nowhere), ENV, f"no Ray cluster at {nowhere}"),
        (
            ("scale", "--region", "east", "--decode", "2", "--ray-address", nowhere),
            ENV,
            f"no Ray cluster at {nowhere}",
        ),
        (  # nothing to change: refused before looking for a cluster (it was a no-op
            # that the controller logged as an operator's decision)
            ("scale", "--region", "east", "--ray-address", nowhere),
            ENV,
            "scale: give --prefill, --decode or both",
        ),
        (  # a flag the step does not read: refused (--promote dropped --canary silently)
            ("rollout", "--model", "m", "--promote", "--canary", "50", "--ray-address", nowhere),
            ENV,
            "canary: applies to a rollout of a --version, not to --promote",
        ),
        (
            ("rollout", "--model", "m", "--version", "v2", "--blue-green", "--canary", "5"),
            ENV,
            "canary: a --blue-green rollout takes all traffic at once",
        ),
        (
            ("submit", "--address", f"http://{nowhere}", "--config", config),
            ENV,
            f"no Ray dashboard at http://{nowhere}",
        ),
        (  # a GCS address: Ray would wait half a minute for it
            ("submit", "--address", nowhere, "--config", config),
            ENV,
            f"no Ray cluster at {nowhere} (nothing listens)",
        ),
        (  # a dashboard's address where a GCS address goes: Ray raised a bare ValueError
            ("status", "--ray-address", f"http://{nowhere}"),
            ENV,
            "--ray-address: 'http://127.0.0.1",
        ),
        (("status",), {**ENV, "RAY_ADDRESS": "head"}, "RAY_ADDRESS: 'head' is not HOST:PORT"),
    ]
    for args, env, says in runs:
        start = time.monotonic()
        result = pdserve(*args, env=env, timeout=120)
        assert says in one_line_error(result, args[0])
        assert time.monotonic() - start < 60  # Ray alone would retry for minutes
        assert "Started a local Ray instance" not in result.stderr


def test_layout_that_cannot_fit_is_refused_before_ray_starts(tmp_path) -> None:
    config = tmp_path / "too-big.yaml"
    config.write_text(
        "model: builtin:tiny\n"
        "ray: {num_cpus: 2}\n"
        "regions:\n"
        "  - name: east\n"
        "    prefill: {count: 1, tensor_parallel_size: 2, num_cpus_per_rank: 1}\n"
        "    decode: {count: 1, num_cpus_per_rank: 1}\n"
        "server: {host: 127.0.0.1, grpc_port: 0, http_port: 0}\n"
        "auth: {disabled: true}\n"
    )
    start = time.monotonic()
    result = pdserve("serve", "--config", str(config), "--ray-address", "local", timeout=180)
    assert "this layout needs 3 CPUs, the cluster has 2" in one_line_error(result, "serve")
    # the embedded Ray's CPUs are the config's: nothing is started to find that out
    assert "Started a local Ray instance" not in result.stderr
    assert time.monotonic() - start < 60
