"""The KubeRay manifests carry the multi-node config and label each region's nodes."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from pdserve.cluster.config import load_config, parse_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def documents(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))


def embedded_config(docs: list[dict]) -> str:
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return config_map["data"]["cluster.yaml"]


def region_labels(cluster_spec: dict) -> dict[str, str]:
    """Each worker group's region, from the labels its Ray nodes start with."""
    out = {}
    for group in cluster_spec["workerGroupSpecs"]:
        labels = dict(p.split("=", 1) for p in group["rayStartParams"]["labels"].split(","))
        out[group["groupName"]] = labels["pdserve/region"]
    return out


def test_configmap_is_the_multinode_example() -> None:
    embedded = parse_config(embedded_config(documents("raycluster.yaml")), "configmap")
    example = load_config(DEPLOY / "configs" / "multinode.yaml")
    assert embedded.regions == example.regions
    assert embedded.model == example.model and embedded.connector == example.connector


def test_every_region_has_a_labelled_worker_group() -> None:
    config = parse_config(embedded_config(documents("raycluster.yaml")), "configmap")
    (cluster,) = [d for d in documents("raycluster.yaml") if d["kind"] == "RayCluster"]
    (job,) = documents("rayjob.yaml")
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        labels = region_labels(spec)
        for region in config.regions:
            assert region.node_labels == {"pdserve/region": region.name}
            assert labels.get(region.name) == region.name
            groups = [g for g in spec["workerGroupSpecs"] if g["groupName"] == region.name]
            gpus = int(
                groups[0]["template"]["spec"]["containers"][0]["resources"]["limits"][
                    "nvidia.com/gpu"
                ]
            )
            for role in (region.prefill, region.decode):
                ranks = 1
                for size in role.parallel.values():
                    ranks *= size
                assert ranks * role.num_gpus_per_rank <= gpus  # an instance fits on one node


def test_rayjob_runs_pdserve_serve_on_the_mounted_config() -> None:
    (job,) = documents("rayjob.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["pdserve", "serve", "--config"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert str(Path(argv[3]).parent) in mounts
    assert head["volumes"][0]["configMap"]["name"] == "pdserve-config"
