"""The KubeRay manifests describe the cluster of deploy/configs/multinode.yaml.

What "the same cluster" means here: the ConfigMap carries that file as it is; the
RayJob makes the RayCluster's cluster and runs ``pdserve serve`` on the config
mounted from the ConfigMap; each region is one worker group, named after it, whose
Ray node labels are the region's ``node_labels``; one node of a group holds any one
instance of its region, and the group's ``minReplicas``, ``replicas`` and
``maxReplicas`` nodes hold the region's fewest, configured and most instances;
every node (the head's controller and router too) mounts the config's model
folder; the head's container opens the config's server ports; and the image the
manifests run has the Ray of their ``rayVersion``. (That the manifests are valid
KubeRay resources is test_kuberay_schema.py's.)
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from pdserve.cluster.config import ClusterConfig, load_config, parse_config
from pdserve.cluster.config_regions import RegionConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MULTINODE = DEPLOY / "configs" / "multinode.yaml"


def documents(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))


def one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents(name) if d["kind"] == kind]
    return doc


def embedded_text() -> str:
    return str(one("raycluster.yaml", "ConfigMap")["data"]["cluster.yaml"])


def config() -> ClusterConfig:
    return parse_config(embedded_text(), "configmap")


def cluster_spec() -> dict[str, Any]:
    return dict(one("raycluster.yaml", "RayCluster")["spec"])


def groups() -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in cluster_spec()["workerGroupSpecs"]}


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return dict(group["template"]["spec"]["containers"][0])  # KubeRay's Ray container


def cpus(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def node_size(group: dict[str, Any]) -> dict[str, float]:
    """The Ray CPUs and GPUs one node of ``group`` starts with: KubeRay takes them
    from the Ray container's limits (its requests if it has none) unless
    ``rayStartParams`` names them."""
    resources = ray_container(group)["resources"]
    limits = resources.get("limits") or resources.get("requests", {})
    params = group.get("rayStartParams", {})
    return {
        "CPU": cpus(params.get("num-cpus", limits.get("cpu", 0))),
        "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
    }


def nodes_for(instances: list[dict[str, float]], node: dict[str, float]) -> int:
    """How many nodes of ``node``'s size hold ``instances``, each on one node (first
    fit, largest first)."""
    free: list[dict[str, float]] = []
    for need in sorted(instances, key=lambda n: (n["GPU"], n["CPU"]), reverse=True):
        assert all(need[k] <= node[k] for k in need), f"an instance of {need} outgrows {node}"
        spot = next((f for f in free if all(need[k] <= f[k] for k in need)), None)
        if spot is None:
            spot = dict(node)
            free.append(spot)
        for key in need:
            spot[key] -= need[key]
    return len(free)


def instances(cfg: ClusterConfig, region: RegionConfig, bound: str) -> list[dict[str, float]]:
    """The Ray resources of each instance of ``region`` at ``bound`` (min, count or
    max of each role; the decode role's warm pool on top)."""
    out = []
    for role in ("prefill", "decode"):
        n = getattr(region.role(role), bound) + (region.warm_pool if role == "decode" else 0)
        out += [cfg.instance_needs(role, region)] * n
    return out


def test_the_configmap_is_the_multinode_config() -> None:
    assert yaml.safe_load(embedded_text()) == yaml.safe_load(MULTINODE.read_text())
    assert parse_config(embedded_text(), str(MULTINODE)) == load_config(MULTINODE)


def test_the_rayjob_makes_the_rayclusters_cluster() -> None:
    assert one("rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"] == cluster_spec()


def test_each_region_is_a_worker_group_with_its_node_labels() -> None:
    cfg = config()
    assert {r.name: r.node_labels for r in cfg.regions} == {
        name: group.get("labels", {}) for name, group in groups().items()
    }
    for region in cfg.regions:
        assert region.node_labels == {"pdserve/region": region.name}


def test_each_group_holds_its_regions_instances() -> None:
    cfg, by_name = config(), groups()
    for region in cfg.regions:
        group = by_name[region.name]
        node = node_size(group)
        low, now, high = group["minReplicas"], group["replicas"], group["maxReplicas"]
        assert low <= now <= high, region.name
        for bound, nodes in (("min", low), ("count", now), ("max", high)):
            need = nodes_for(instances(cfg, region, bound), node)
            assert need <= nodes, f"{region.name}: {bound} instances need {need} nodes of {node}"
    total = {k: sum(node_size(g)[k] * g["replicas"] for g in by_name.values()) for k in node}
    assert all(amount <= total[k] for k, amount in cfg.needs().items()), (cfg.needs(), total)


def test_every_node_mounts_the_model_folder() -> None:
    model = Path(config().model)
    spec = cluster_spec()
    for name, group in {"head": spec["headGroupSpec"], **groups()}.items():
        pod = group["template"]["spec"]
        volumes = {v["name"] for v in pod["volumes"]}
        mounts = [m for m in ray_container(group)["volumeMounts"] if m["name"] in volumes]
        assert any(model.is_relative_to(m["mountPath"]) for m in mounts), name


def test_the_head_opens_the_configs_ports() -> None:
    server = yaml.safe_load(embedded_text())["server"]
    ports = {
        p["name"]: p["containerPort"]
        for p in ray_container(cluster_spec()["headGroupSpec"])["ports"]
    }
    assert (ports["grpc"], ports["http"]) == (server["grpc_port"], server["http_port"])


def test_the_image_has_the_ray_of_ray_version() -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    (tag,) = re.findall(r"^FROM rayproject/ray:(\S+)", dockerfile, re.MULTILINE)
    assert tag.split("-")[0] == cluster_spec()["rayVersion"]


def test_rayjob_runs_pdserve_serve_on_the_mounted_config() -> None:
    config_map = one("raycluster.yaml", "ConfigMap")
    job = one("rayjob.yaml", "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["pdserve", "serve", "--config"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    (volume,) = [v for v in head["template"]["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in ray_container(head)["volumeMounts"] if m["name"] == volume["name"]]
    assert Path(argv[3]) == Path(mount["mountPath"]) / "cluster.yaml"
    assert "cluster.yaml" in config_map["data"]
