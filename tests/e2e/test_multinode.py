"""A multi-node Ray cluster on one machine, as Ray's own tests build one
(``ray.cluster_utils.Cluster``): each node its own raylet with its own CPUs and
``pdserve/region`` label. The head holds no CPU (as a KubeRay head is usually set
up: the controller and router need none). Region ``east`` is pinned to the two
nodes labelled east (one rank fits on each: its prefill and decode instances run
on different nodes), region ``west`` to a node of two CPUs (both on one node).

The config names no connector: ``auto`` moves the KV pages over shared memory
between ranks of one node and over the object store between nodes. Where each
instance runs is read from Ray's placement groups, not from pdserve's records.

These tests run in a pytest process of their own (the ``multinode`` step of
tests/lanes.py), since a process holds one Ray connection.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import time
import urllib.request

import grpc
import psutil
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from pdserve import LLM, SamplingParams
from pdserve.cluster.config import parse_config
from pdserve.cluster.serve import start_controller
from pdserve.router.frontdoor.proto.gen import completion_pb2 as pb
from pdserve.router.frontdoor.proto.gen import completion_pb2_grpc as pb_grpc
from tests.e2e.local_cluster import generate

pytestmark = pytest.mark.multinode

LABEL = "pdserve/region"
CONFIG = """\
model: builtin:tiny
engine: {dtype: float32, max_num_batched_tokens: 256}
regions:
  - name: east
    latency_ms: {west: 30000}
    node_labels: {pdserve/region: east}
    prefill: {count: 1, min: 1, max: 1, num_cpus_per_rank: 1}
    decode: {count: 1, min: 1, max: 1, num_cpus_per_rank: 1}
  - name: west
    latency_ms: {east: 30000}
    node_labels: {pdserve/region: west}
    prefill: {count: 1, min: 1, max: 1, num_cpus_per_rank: 1}
    decode: {count: 1, min: 1, max: 1, num_cpus_per_rank: 1}
slo: {ttft_ms: 5000, tpot_ms: 1000}
server: {host: "127.0.0.1", grpc_port: 0, http_port: 0}
auth: {disabled: true}
disaggregation: {local_prefill_max_tokens: 4}
health: {start_timeout_s: 20, place_timeout_s: 6}
"""
PROMPTS = [[3 + (seed * 7919 + i * 104729) % 1000 for i in range(40)] for seed in range(4)]
TOKENS = 12


@pytest.fixture(scope="module")
def cluster():
    """The nodes, this process connected to them."""
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    for cpus, region in ((1, "east"), (1, "east"), (2, "west")):
        cluster.add_node(num_cpus=cpus, labels={LABEL: region})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def nodes(cluster) -> dict[str, str | None]:
    """Node id -> region label, of every node alive now."""
    return _labels()


def _labels() -> dict[str, str | None]:
    return {n["NodeID"]: n["Labels"].get(LABEL) for n in ray.nodes() if n["Alive"]}


@pytest.fixture(scope="module")
def served(nodes):
    controller, endpoints = start_controller(parse_config(CONFIG, "multinode.yaml"))
    stub = pb_grpc.CompletionStub(grpc.insecure_channel(endpoints.grpc_address))
    try:
        yield controller, endpoints, stub
    finally:
        ray.get(controller.stop.remote())
        ray.kill(controller)


def _placed(nodes: dict[str, str | None]) -> list[tuple[str, str | None]]:
    """(node id, region label) of every bundle of every live placement group."""
    return [(node, nodes[node]) for _, node in _bundles()]


def _bundles() -> list[tuple[str, str]]:
    """(placement group name, node id) of every bundle of every placed group."""
    return [
        (group["name"], node)
        for group in placement_group_table().values()
        if group["state"] == "CREATED"
        for node in group["bundles_to_node_id"].values()
    ]


def test_each_region_runs_on_its_nodes_and_kv_crosses_nodes_over_the_object_store(
    nodes, served
) -> None:
    _, endpoints, stub = served
    placed = _placed(nodes)
    # four single-rank instances, two on the nodes of each region's label
    assert sorted(label for _, label in placed) == ["east", "east", "west", "west"]
    east = {node for node, label in placed if label == "east"}
    west = {node for node, label in placed if label == "west"}
    assert len(east) == 2 and len(west) == 1  # east's prefill and decode: one node each

    want = [
        LLM("builtin:tiny")
        .generate([p], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
        for p in PROMPTS
    ]
    for region in ("east", "west"):
        got = [generate(stub, p, TOKENS, region=region) for p in PROMPTS]
        assert got == want, region

    # Both regions prefilled on their prefill instance and handed the pages over: east's
    # between two nodes over the object store, west's on one node over shared memory.
    url = f"http://{endpoints.host}:{endpoints.http_port}/metrics"
    deadline, sent = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # the controller pushes counters every health round
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        sent = _sent_bytes(text)
        if sent.get(("east", "object_store")) and sent.get(("west", "shm")):
            break
        time.sleep(0.5)
    assert sent.get(("east", "object_store"), 0) > 0, sent
    assert sent.get(("west", "shm"), 0) > 0, sent
    assert sent.get(("west", "object_store"), 0) == 0, sent  # one node: no detour

    # the dashboard names the node each instance runs on: the node Ray placed it on
    ray_says = {name.rsplit("-", 1)[0].removeprefix("pdserve-"): n for name, n in _bundles()}
    data = json.loads(urllib.request.urlopen(f"{url[: -len('/metrics')]}/dashboard/data").read())
    assert {i["instance"]: i["node_id"] for i in data["instances"]} == ray_says


def _sent_bytes(metrics: str) -> dict[tuple[str, str], float]:
    """(region, connector) -> KV bytes sent, from the Prometheus text."""
    out: dict[tuple[str, str], float] = {}
    for line in metrics.splitlines():
        if not line.startswith("pdserve_transfer_bytes_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if labels.get("direction") == "sent":
            key = (labels["region"], labels["connector"])
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_node_lost_under_load_moves_its_streams_and_its_instance_comes_back(
    cluster, served
) -> None:
    """East's decode node dies whole (its raylet and every process it started) while streams run
    in east: each stream ends with exactly the tokens of an undisturbed run, and the
    decode instance comes back on the spare east node added before."""
    controller, _, stub = served
    spare = cluster.add_node(num_cpus=1, labels={LABEL: "east"})
    cluster.wait_for_nodes()
    victim = _node_of(cluster, "pdserve-east-decode")

    outage = _kill_under_load(cluster, controller, victim, stub)
    print(f"\nnode lost: the last stream resumed {outage:.2f} s after the kill")
    router = ray.get(ray.get(controller.router_handle.remote()).stats.remote())
    assert router.migrations >= 1

    def back() -> bool:  # east's decode instance, serving again, placed on the spare
        placed = {node for name, node in _bundles() if name.startswith("pdserve-east-decode")}
        return placed == {spare.node_id} and _region(controller, "east").decode == 1

    deadline = time.monotonic() + 120
    while not back():
        assert time.monotonic() < deadline, (_bundles(), spare.node_id)
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while not ray.get(controller.all_idle.remote()):  # no page or request held anywhere
        assert time.monotonic() < deadline
        time.sleep(0.2)
    events = "\n".join(ray.get(controller.status.remote()).events)
    assert re.search(r"east-decode-\d+ is unhealthy \(.*\): replacing it", events), events


def test_a_region_whose_nodes_cannot_hold_it_spills_and_says_why(cluster, served) -> None:
    """East's decode node dies again, and no east node has room left: the streams move
    to west's decode instance, east's requests are served there, and the region's status
    names the start that cannot be placed."""
    controller, _, stub = served
    outage = _kill_under_load(cluster, controller, _node_of(cluster, "pdserve-east-decode"), stub)
    print(f"\nnode lost, no room in east: the last stream resumed {outage:.2f} s after")

    deadline = time.monotonic() + 90
    while not (region := _region(controller, "east")).failed_starts:
        assert time.monotonic() < deadline, region
        time.sleep(0.5)
    assert region.decode == 0 and region.target_decode == 1
    assert "were not placed within 6 s" in region.last_error, region
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    want = LLM("builtin:tiny").generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    assert generate(stub, PROMPTS[0], TOKENS, region="east") == want  # served in west
    assert ray.get(controller.all_idle.remote())


def _region(controller, name: str):
    """The region's line of the cluster status (as `pdserve status` prints it)."""
    return next(r for r in ray.get(controller.status.remote()).regions if r.name == name)


def _node_of(cluster, group: str):
    """The node that holds the placement group whose name starts with ``group``."""
    [node_id] = {node for name, node in _bundles() if name.startswith(group)}
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def _kill_node(cluster, node) -> None:
    """The node's raylet and every process it started (its workers: the ranks of the
    instances placed there), all at once, as a machine that is lost."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    workers = raylet.children(recursive=True)
    for p in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    cluster.remove_node(node, allow_graceful=False)
    psutil.wait_procs(workers, timeout=10)


def _decode_stats(controller) -> list:
    leaders = [h for role, h in ray.get(controller.instance_handles.remote()) if role == "decode"]
    return ray.get([h.stats.remote() for h in leaders])


def _kill_under_load(cluster, controller, victim, stub, tokens: int = 120) -> float:
    """Kill node ``victim`` whole while three streams decode in east; each stream ends
    with the tokens of an undisturbed run. Seconds from the kill until the last stream
    that paused resumed."""
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    want = [LLM("builtin:tiny").generate([p], params)[0].outputs[0].token_ids for p in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]  # when each stream's chunks came
    results: dict[int, list[int]] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            results[i] = _stream(stub, prompts[i], tokens, arrivals[i])
        except Exception as e:  # reported below, with the others
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(len(a) for a in arrivals) < 5:  # every stream is decoding
        assert time.monotonic() < deadline, arrivals
        time.sleep(0.05)
    # the streams decode on the node about to die (east's decode instance holds them)
    held = {s.instance_id: s.num_blocks - s.free_blocks for s in _decode_stats(controller)}
    assert [i for i, used in held.items() if used and i.startswith("east-")], held
    killed = time.monotonic()
    _kill_node(cluster, victim)
    for t in threads:
        t.join(timeout=180)
    assert errors == []
    assert [results[i] for i in range(len(prompts))] == want
    # each stream's longest pause after the kill ends when it resumed
    return max(end for _, end in (_pause_after(a, killed) for a in arrivals))


def _stream(stub, prompt: list[int], max_tokens: int, arrivals: list[float]) -> list[int]:
    """A greedy stream in east; ``arrivals`` gets the time of every chunk."""
    request = pb.CompletionRequest(prompt_token_ids=pb.TokenIds(ids=prompt), region="east")
    request.sampling.CopyFrom(
        pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    tokens: list[int] = []
    for chunk in stub.Generate(request, timeout=180):
        tokens.extend(chunk.token_ids)
        arrivals.append(time.monotonic())
    return tokens


def _pause_after(arrivals: list[float], since: float) -> tuple[float, float]:
    """The longest gap between two chunks that ends after ``since``, and its end after it."""
    gaps = [(b - a, b - since) for a, b in itertools.pairwise(arrivals) if b > since]
    return max(gaps, default=(0.0, 0.0))
