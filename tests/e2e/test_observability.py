"""Observability of a running local cluster: /metrics, Prometheus, the dashboard, tracing."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.config import parse_config
from pdserve.cluster.serve import start_controller
from pdserve.core.metrics import BY_NAME, PHASES, exported_names
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("PDSERVE_TEST_ARTIFACTS", ROOT / "test-artifacts"))
KEY = "observability-test-key"
CONFIG = f"""\
model: builtin:tiny
connector: shm
engine: {{dtype: float32, max_num_batched_tokens: 256, host_tier_bytes: 4000000}}
regions:
  - name: east
    prefill: {{count: 1, min: 1, max: 2, num_cpus_per_rank: 0.25}}
    decode: {{count: 1, min: 1, max: 2, num_cpus_per_rank: 0.25}}
slo: {{ttft_ms: 2000, tpot_ms: 200}}
server: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
auth: {{api_keys: [{KEY}]}}
planner: {{mode: advisory, interval_s: 1, cooldown_s: 5}}
disaggregation: {{local_prefill_max_tokens: 4}}
"""


def system_tool(name: str) -> str:
    """A Debian package's binary; CI installs them (.ci/run), elsewhere a missing one skips."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (.ci/run installs it)")
        pytest.skip(f"{name} is not installed (apt-get install {name})")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self) -> None:
        self.controller, self.endpoints = start_controller(parse_config(CONFIG, "obs.yaml"))
        self.base = f"http://{self.endpoints.host}:{self.endpoints.http_port}"
        self.stub = pb_grpc.CompletionStub(
            grpc.insecure_channel(f"{self.endpoints.host}:{self.endpoints.grpc_port}")
        )

    def complete(self, prompt: list[int], max_tokens: int = 6, request_id: str = "") -> list[int]:
        request = pb.CompletionRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            request_id=request_id,
        )
        r = self.stub.Complete(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
        return list(r.token_ids)

    def get(self, path: str, key: str | None = KEY) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.base + path, headers=headers), timeout=30
            ) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = self.get("/metrics")
        assert status == 200, text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(
            v
            for (n, ls), v in self.samples().items()
            if n == name and all(dict(ls).get(k) == val for k, val in labels.items())
        )

    def stop(self) -> None:
        ray.get(self.controller.stop.remote())
        ray.kill(self.controller)


def prompt(i: int, n: int = 40) -> list[int]:
    return [(i * 13 + j * 7) % 200 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = Cluster()
    for i in range(4):
        assert len(c.complete(prompt(i))) == 6
    yield c
    c.stop()


def wait_for(check, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_metrics_endpoint_serves_the_catalog(cluster: Cluster) -> None:
    assert cluster.get("/metrics", key=None)[0] == 401
    assert cluster.get("/metrics", key="wrong")[0] == 401
    # The instances' counters come with the controller's health rounds: a round taken
    # while the fixture's requests ran carries only some of them, so wait for the round
    # that carries all four.
    wait_for(
        lambda: (
            cluster.value("pdserve_transfer_bytes_total", direction="sent") > 0
            and cluster.value("pdserve_leases_total", role="decode", outcome="committed") >= 4
            and cluster.value("pdserve_prefix_cache_queries_total", role="prefill") >= 4 * 40
        ),
        what="the instances' counters of the four requests",
    )
    samples = cluster.samples()
    names = {n for n, _ in samples}
    assert names <= exported_names(), sorted(names - exported_names())
    assert cluster.value("pdserve_requests_total", region="east", status="length") >= 4
    assert cluster.value("pdserve_time_to_first_token_seconds_count", region="east") >= 4
    assert cluster.value("pdserve_time_per_output_token_seconds_count", region="east") >= 4
    assert cluster.value("pdserve_inter_token_latency_seconds_count", region="east") >= 4 * 5
    for phase in PHASES:
        count = cluster.value("pdserve_request_phase_seconds_count", region="east", phase=phase)
        assert count >= 4, phase
    assert cluster.value("pdserve_instances", region="east", role="prefill", state="serving") == 1
    assert cluster.value("pdserve_instances", region="east", role="decode", state="serving") == 1
    assert cluster.value("pdserve_pd_ratio", region="east", kind="actual") == 1.0
    assert cluster.value("pdserve_leases_total", role="decode", outcome="committed") >= 4
    assert cluster.value("pdserve_prefix_cache_queries_total", role="prefill") >= 4 * 40
    assert 0.0 <= cluster.value("pdserve_kv_usage_ratio", role="decode") <= 1.0
    assert cluster.value("pdserve_queue_length", role="prefill") == 0
    # Prefix blocks are written down to each instance's host tier as they are cached.
    assert cluster.value("pdserve_kv_tier_bytes_total", role="prefill", direction="in") > 0
    assert cluster.value("pdserve_kv_tier_blocks", role="prefill", tier="host") > 0
    for phase in ("schedule", "spawn", "load", "warmup"):
        assert cluster.value("pdserve_instance_start_seconds", role="decode", phase=phase) > 0

    # A refused request is counted by reason, and the server stays up.
    bad = pb.CompletionRequest(prompt_token_ids=pb.TokenIds(ids=prompt(9)))
    with pytest.raises(grpc.RpcError) as refused:
        cluster.stub.Complete(bad, metadata=(("authorization", "Bearer nope"),), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert cluster.value("pdserve_rejections_total", reason="unauthenticated") >= 1
    assert len(cluster.complete(prompt(10))) == 6


def test_prometheus_scrapes_the_cluster(cluster: Cluster, tmp_path: Path) -> None:
    binary = system_tool("prometheus")
    (tmp_path / "key").write_text(KEY)
    host = f"{cluster.endpoints.host}:{cluster.endpoints.http_port}"
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "pdserve",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "key")},
                "static_configs": [{"targets": [host]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        query = urllib.parse.urlencode(
            {"query": 'sum(pdserve_requests_total{region="east",status="length"})'}
        )

        def answer() -> float | None:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/v1/query?{query}", timeout=5
                ) as r:
                    result = json.load(r)["data"]["result"]
            except (OSError, KeyError):
                return None
            return float(result[0]["value"][1]) if result else None

        value = wait_for(answer, timeout_s=90, what="Prometheus to scrape pdserve")
        assert value >= 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_dashboard_draws_and_shows_a_scale_in_chromium(cluster: Cluster) -> None:
    chromium = system_tool("chromium")
    driver_path = system_tool("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    status, page = cluster.get("/dashboard", key=None)
    assert status == 200 and "dashboard.js" in page
    assert cluster.get("/dashboard/data", key=None)[0] == 401
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1100"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    scaler: threading.Thread | None = None
    try:
        browser.get(f"{cluster.base}/dashboard#key={KEY}")

        def drawn() -> bool:
            canvases = browser.find_elements(By.CSS_SELECTOR, 'canvas[data-chart="pd"]')
            return bool(canvases) and all(int(c.get_attribute("data-points")) > 0 for c in canvases)

        wait_for(drawn, timeout_s=30, what="the P:D chart to draw")
        ttft = browser.find_element(By.CSS_SELECTOR, 'canvas[data-chart="ttft"]')
        assert int(ttft.get_attribute("data-points")) > 0  # requests ran before the page opened
        tiers = browser.find_element(By.CSS_SELECTOR, 'canvas[data-chart="tiers"]')
        assert int(tiers.get_attribute("data-points")) > 0  # the instances' host tiers
        # each instance with the Ray node it runs on (one node here)
        [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"]]

        def placed() -> list[tuple[str, str | None]]:
            rows = browser.find_elements(By.CSS_SELECTOR, "#instances tr.instance")
            return sorted((r.text.split()[2], r.get_attribute("data-node")) for r in rows)

        wait_for(lambda: placed() == [("decode", node), ("prefill", node)], what="nodes shown")

        # `pdserve scale` (the controller call behind it) shows up within seconds,
        # while the new instance is still starting.
        scaler = threading.Thread(
            target=lambda: ray.get(cluster.controller.scale.remote("east", None, 2)), daemon=True
        )
        started = time.monotonic()
        scaler.start()

        def logged() -> bool:
            rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#events tr.event")]
            return any("east" in r and "set" in r and "1:2" in r for r in rows)

        wait_for(logged, timeout_s=15, what="the scale decision on the page")
        seen_after = time.monotonic() - started
        scaler.join(timeout=120)
        wait_for(
            lambda: browser.find_element(By.CSS_SELECTOR, ".region .pd").text.startswith("1P : 2D"),
            timeout_s=30,
            what="the new decode instance on the page",
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
        assert seen_after < 15
    finally:
        browser.quit()
        if scaler is not None:
            scaler.join(timeout=120)
        ray.get(cluster.controller.scale.remote("east", None, 1))


def test_one_grep_follows_a_request(cluster: Cluster) -> None:
    rid = "trace-me-0042"
    assert len(cluster.complete(prompt(11), request_id=rid)) == 6
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"

    def lines() -> list[str]:
        found = []
        for path in logs.glob("worker-*.err"):
            found += [line for line in path.read_text(errors="replace").splitlines() if rid in line]
        return found

    def complete() -> list[str] | None:
        found = lines()
        text = "\n".join(found)
        # The engines know the request by the router's id, which extends the client's.
        parts = (
            rf"request {rid}\.\w+:",
            rf"prefill {rid}\.\w+:",
            rf"decode {rid}\.\w+: hand-off",
            rf"decode {rid}\.\w+: finished",
        )
        return found if all(re.search(p, text) for p in parts) else None

    found = wait_for(complete, timeout_s=20, what="the request's log lines")
    # Router, prefill and decode are three processes.
    assert len({re.search(r"pid=(\d+)", line).group(1) for line in found}) >= 3


def test_grafana_dashboard_queries_only_catalog_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"\bpdserve_[a-z_]+", e)}
    assert used and used <= exported_names(), sorted(used - exported_names())
    # What the issue asks the dashboard to show is there.
    for needed in (
        "pdserve_instances",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_kv_usage_ratio",
        "pdserve_transfer_bytes_total",
    ):
        assert needed in used
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_catalog_follows_prometheus_naming() -> None:
    for spec in BY_NAME.values():
        assert spec.name.startswith("pdserve_")
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds") and spec.buckets, spec.name
