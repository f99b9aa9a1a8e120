"""Every document of deploy/k8s/ is one a cluster with KubeRay's CRDs accepts.

Each custom resource is checked against the schema of its CRD's version (what the
API server refuses, tests/cluster/kuberay.py) and against the rules KubeRay's
operator applies to a cluster spec; the other documents are skipped by kind, and
the kinds skipped are named here, so a new kind is never passed over unseen.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import kuberay

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# Kinds of the core API in the manifests: no CRD describes them.
NOT_CUSTOM = {"ConfigMap"}


def manifests() -> list[tuple[str, int, dict[str, Any]]]:
    """(file, index, document) of every document of every manifest."""
    return [
        (path.name, i, doc)
        for path in sorted(K8S.glob("*.yaml"))
        for i, doc in enumerate(yaml.safe_load_all(path.read_text()))
        if doc is not None
    ]


def custom(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, _, d in manifests() if d["kind"] == kind]
    return doc


def test_the_manifests_are_found_and_only_known_kinds_are_skipped() -> None:
    found = manifests()
    assert {name for name, _, _ in found} == {"raycluster.yaml", "rayjob.yaml"}
    skipped = {doc["kind"] for _, _, doc in found if not kuberay.is_custom_resource(doc)}
    assert skipped == NOT_CUSTOM
    checked = {doc["kind"] for _, _, doc in found if kuberay.is_custom_resource(doc)}
    assert checked == {"RayCluster", "RayJob"}


def test_the_crds_are_kuberays_three() -> None:
    assert set(kuberay.crds()) == {("ray.io", k) for k in ("RayCluster", "RayJob", "RayService")}


CUSTOM = [
    pytest.param(name, index, doc, id=f"{name}:{index}:{doc['kind']}")
    for name, index, doc in manifests()
    if kuberay.is_custom_resource(doc)
]


@pytest.mark.parametrize(("name", "index", "doc"), CUSTOM)
def test_each_custom_resource_is_valid(name: str, index: int, doc: dict[str, Any]) -> None:
    entry = kuberay.version_entry(doc)
    assert entry is not None, f"{name}:{index}: {doc['apiVersion']} {doc['kind']}"
    # The version the cluster stores: a served, not deprecated, version.
    assert entry["storage"] and not entry.get("deprecated"), doc["apiVersion"]
    found = [str(p) for p in kuberay.problems(doc) + kuberay.operator_problems(doc)]
    assert not found, f"{name}:{index} ({doc['kind']}):\n" + "\n".join(found)


Edit = Callable[[dict[str, Any]], None]


def _rename(old: str, new: str) -> Edit:
    def edit(where: dict[str, Any]) -> None:
        where[new] = where.pop(old)

    return edit


def _set(key: str, value: Any) -> Edit:
    def edit(where: dict[str, Any]) -> None:
        where[key] = value

    return edit


def _group(edit: Edit) -> Edit:
    """``edit`` applied to the second worker group."""
    return lambda doc: edit(doc["spec"]["workerGroupSpecs"][1])


def _container(edit: Edit) -> Edit:
    """``edit`` applied to the second worker group's container."""
    return _group(lambda group: edit(group["template"]["spec"]["containers"][0]))


GROUP = "spec.workerGroupSpecs[1]"
CONTAINER = f"{GROUP}.template.spec.containers[0]"
# A change to the RayCluster; the one problem it makes: its path, part of its message.
BROKEN: dict[str, tuple[Edit, str, str]] = {
    "misspelt field": (_group(_rename("replicas", "replica")), f"{GROUP}.replica", "unknown field"),
    "wrong type": (
        _group(_set("maxReplicas", "4")),
        f"{GROUP}.maxReplicas",
        "is not of type 'integer'",
    ),
    "missing required": (
        _group(lambda group: group.pop("groupName")),
        f"{GROUP}.groupName",
        "required field is missing",
    ),
    "over int32": (_group(_set("minReplicas", 2**31)), f"{GROUP}.minReplicas", "is not a 'int32'"),
    "null": (_group(_set("suspend", None)), f"{GROUP}.suspend", "None is not of type 'boolean'"),
    "unknown field deep down": (
        _container(_set("imagePullPolcy", "Always")),
        f"{CONTAINER}.imagePullPolcy",
        "unknown field",
    ),
    "not a quantity": (
        _container(lambda c: c["resources"]["limits"].update(cpu="8 cores")),
        f"{CONTAINER}.resources.limits.cpu",
        "does not match",
    ),
    "duplicate list-map key (after defaulting)": (
        _container(
            _set("ports", [{"containerPort": 80}, {"containerPort": 80, "protocol": "TCP"}])
        ),
        f"{CONTAINER}.ports[1]",
        "duplicate entry",
    ),
    "not in the enum": (
        lambda doc: doc["spec"].update(autoscalerOptions={"version": "v3"}),
        "spec.autoscalerOptions.version",
        "is not one of",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_document_is_reported_with_its_path(case: str) -> None:
    edit, path, message = BROKEN[case]
    doc = copy.deepcopy(custom("RayCluster"))
    edit(doc)
    found = kuberay.problems(doc)
    assert [p.path for p in found] == [path], found
    assert message in found[0].message


@pytest.mark.parametrize(
    ("field", "value", "path", "message"),
    [
        ("name", "Pdserve_1", "metadata.name", "does not match"),
        ("lables", {"app": "pdserve"}, "metadata.lables", "unknown field"),
        ("labels", {"app": "two words"}, "metadata.labels.app", "does not match"),
    ],
)
def test_the_metadata_is_checked_as_objectmeta(
    field: str, value: Any, path: str, message: str
) -> None:
    doc = copy.deepcopy(custom("RayJob"))
    doc["metadata"][field] = value
    found = kuberay.problems(doc)
    assert [p.path for p in found] == [path] and message in found[0].message, found


def test_a_cel_rule_is_evaluated_and_a_transition_rule_passed_over() -> None:
    doc = copy.deepcopy(custom("RayJob"))
    doc["spec"]["managedBy"] = "someone-else"  # also `self == oldSelf`: update only
    (found,) = kuberay.problems(doc)
    assert found.path == "spec.managedBy" and "must be either" in found.message
    doc["spec"]["managedBy"] = "ray.io/kuberay-operator"
    doc["spec"]["deletionStrategy"] = {"onSuccess": {"policy": "DeleteCluster"}}
    (found,) = kuberay.problems(doc)
    assert found.path == "spec.deletionStrategy" and "requires either BOTH" in found.message


def test_open_objects_int_or_string_and_nullable_follow_the_structural_rules() -> None:
    number = {"type": "integer", "format": "int32"}
    schema = kuberay.structural(
        {
            "type": "object",
            "properties": {
                "open": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"n": number},
                },
                "shut": {"type": "object", "properties": {"n": number}},
                "empty": {"type": "object"},
                "port": {
                    "x-kubernetes-int-or-string": True,
                    "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "pattern": "^[a-z]+$",
                },
                "maybe": {"type": "string", "nullable": True},
            },
        }
    )
    validator = kuberay.KubeValidator(schema, format_checker=kuberay.FORMATS)
    fine = {"open": {"n": 1, "more": {"x": 1}}, "shut": {"n": 1}, "port": 8000, "maybe": None}
    assert kuberay.check(validator, fine) == []
    assert kuberay.check(validator, {**fine, "port": "http"}) == []
    broken = {"open": {"n": "1"}, "shut": {"n": 1, "m": 2}, "empty": {"a": 1}, "port": "HTTP"}
    assert sorted(str(p) for p in kuberay.check(validator, broken)) == [
        "empty.a: unknown field",
        "open.n: '1' is not of type 'integer'",
        "port: 'HTTP' does not match '^[a-z]+$'",
        "shut.m: unknown field",
    ]
    assert [p.path for p in kuberay.check(validator, {"port": 1.5})] == ["port"]


def test_a_kind_or_version_the_crds_lack_is_reported_not_skipped() -> None:
    doc = copy.deepcopy(custom("RayCluster"))
    assert kuberay.is_custom_resource({**doc, "kind": "RayClusterr"})
    assert [p.path for p in kuberay.problems({**doc, "kind": "RayClusterr"})] == ["kind"]
    assert [p.path for p in kuberay.problems({**doc, "apiVersion": "ray.io/v2"})] == ["apiVersion"]


def test_the_operator_refuses_ray_start_labels_and_bad_replica_bounds() -> None:
    doc = copy.deepcopy(custom("RayJob"))
    group = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["rayStartParams"] = {"labels": "pdserve/region=us-east"}
    group["minReplicas"] = 5
    where = "spec.rayClusterSpec.workerGroupSpecs[0]"
    found = kuberay.operator_problems(doc)
    assert [p.path for p in found] == [f"{where}.rayStartParams.labels", where], found
    assert not kuberay.problems(doc)  # the schema takes both: only the operator refuses them
