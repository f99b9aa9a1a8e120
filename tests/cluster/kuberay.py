"""Check Kubernetes manifests against KubeRay's CRDs the way a cluster would.

The CRDs (``tests/data/kuberay-crds/``, with their source and version) each give,
per API version, the ``openAPIV3Schema`` the API server checks a custom resource
against. :func:`problems` applies it to one manifest document with ``jsonschema``,
after turning the CRD's OpenAPI v3 subset into the JSON schema the server in
effect enforces (:func:`structural`):

- a field the schema does not name is an error (``unknown field``), as under
  ``kubectl apply``'s strict field validation (the server would otherwise drop
  it): every object schema without ``additionalProperties`` is closed, unless it
  says ``x-kubernetes-preserve-unknown-fields: true``;
- ``x-kubernetes-int-or-string`` takes an integer or a string (a quantity's
  ``pattern`` applies to the string), ``nullable`` admits ``null``; a ``null``
  anywhere else is reported (the server would drop it silently);
- ``format`` ``int32``, ``int64`` and ``date-time`` are checked, as are
  ``required``, ``enum``, ``pattern``, ``minimum`` and the other value checks;
- ``x-kubernetes-list-type`` ``map`` and ``set`` lists hold no two entries with
  the same key (``map``, after defaulting) or value (``set``);
- ``x-kubernetes-validations`` (CEL) rules: those that compare with ``oldSelf``
  apply to updates only and are passed over; the others are evaluated by a
  Python rendering of each rule the CRDs hold (:data:`CEL_RULES`), and a rule
  without one is reported rather than skipped;
- the top-level ``metadata``, which the CRDs leave an open object, is checked
  as the server checks ObjectMeta: a DNS-subdomain ``name``, a DNS-label
  ``namespace``, Kubernetes label syntax and ObjectMeta's fields only.

Defaults of the schema are applied before the checks, as the server does.
:func:`operator_problems` adds the rules KubeRay's operator applies to a cluster
spec before it makes pods (which a schema cannot state).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema.exceptions import ValidationError

CRDS = Path(__file__).resolve().parents[1] / "data" / "kuberay-crds"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 1 MB each

DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{DNS_LABEL}(\.{DNS_LABEL})*"
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY = rf"^({DNS_SUBDOMAIN}/)?{LABEL_NAME}$"
LABEL_VALUE = rf"^({LABEL_NAME})?$"
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "required": ["name"],  # kubectl apply names every object it creates
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": f"^{DNS_SUBDOMAIN}$"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string", "maxLength": 63, "pattern": f"^{DNS_LABEL}$"},
        "labels": {
            "type": "object",
            "propertyNames": {"pattern": LABEL_KEY},
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE},
        },
        "annotations": _STRING_MAP,
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
        "managedFields": {"type": "array", "items": {"type": "object"}},
        **{key: {"type": "string"} for key in ("uid", "resourceVersion", "selfLink")},
        **{key: {"type": "string"} for key in ("creationTimestamp", "deletionTimestamp")},
        **{key: {"type": "integer"} for key in ("generation", "deletionGracePeriodSeconds")},
    },
}


def _has(value: Any, *names: str) -> list[bool]:
    return [isinstance(value, dict) and name in value for name in names]


# Each CEL rule of the CRDs that can fail on create, as a predicate of its ``self``.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": lambda v: (
        v in ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue")
    ),
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": lambda v: (
        not ((any(_has(v, "onSuccess", "onFailure"))) and all(_has(v, "deletionRules")))
    ),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": lambda v: (
        all(_has(v, "onSuccess", "onFailure")) or all(_has(v, "deletionRules"))
    ),
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": lambda v: (
        not all(_has(v, "jobStatus", "jobDeploymentStatus"))
    ),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": lambda v: any(
        _has(v, "jobStatus", "jobDeploymentStatus")
    ),
}


@dataclass(frozen=True)
class Problem:
    """One thing the server would refuse: the field's path and what is wrong with it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@cache
def crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(group, kind) -> its CustomResourceDefinition."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=LOADER)
        assert crd["kind"] == "CustomResourceDefinition", path
        out[(crd["spec"]["group"], crd["spec"]["names"]["kind"])] = crd
    return out


def group_version(doc: dict[str, Any]) -> tuple[str, str]:
    """``ray.io/v1`` -> (``ray.io``, ``v1``); the core group (``v1``) is ``""``."""
    group, _, version = str(doc.get("apiVersion", "")).rpartition("/")
    return group, version


def is_custom_resource(doc: dict[str, Any]) -> bool:
    """Whether ``doc`` belongs to a group the CRDs define (then its kind must be one)."""
    return group_version(doc)[0] in {group for group, _ in crds()}


def version_entry(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The CRD's entry for ``doc``'s kind and version, if the CRD has it."""
    group, version = group_version(doc)
    crd = crds().get((group, doc.get("kind", "")))
    entries = crd["spec"]["versions"] if crd else []
    return next((v for v in entries if v["name"] == version), None)


def structural(schema: dict[str, Any], closed: bool = True) -> dict[str, Any]:
    """``schema`` (a CRD's OpenAPI v3) as the JSON schema the API server enforces.

    ``closed``: whether an object here rejects the fields it does not name; the
    branches of ``allOf``/``anyOf``/``oneOf``/``not`` are not (in a structural
    schema they only add value checks to the fields named outside them).
    """
    out = {k: v for k, v in schema.items() if k != "description"}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("anyOf", None)  # [{type: integer}, {type: string}]
        out["type"] = ["integer", "string"]
    if out.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if out.get("x-kubernetes-embedded-resource"):
        kinds = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}
        out["properties"] = {**kinds, "metadata": OBJECT_META, **out.get("properties", {})}
    if "properties" in out:
        out["properties"] = {k: structural(v) for k, v in out["properties"].items()}
    for key in ("additionalProperties", "items"):
        if isinstance(out.get(key), dict):
            out[key] = structural(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [structural(s, closed=False) for s in out[key]]
    if "not" in out:
        out["not"] = structural(out["not"], closed=False)
    open_ = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if closed and out.get("type") == "object" and not open_:
        out["additionalProperties"] = False
    return out


def _list_type(
    validator: Any, list_type: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """``x-kubernetes-list-type``: no two entries of a ``set`` alike, nor two of a
    ``map`` with the same ``x-kubernetes-list-map-keys``."""
    if not isinstance(instance, list) or list_type not in ("set", "map"):
        return
    names = schema.get("x-kubernetes-list-map-keys", [])
    seen: set[str] = set()
    for i, item in enumerate(instance):
        if list_type == "map" and isinstance(item, dict):
            key = json.dumps({name: item.get(name) for name in names}, sort_keys=True)
        else:
            key = json.dumps(item, sort_keys=True)
        if key in seen:
            yield ValidationError(f"duplicate entry {key}", path=[i])
        seen.add(key)


def _cel_rules(
    validator: Any, rules: list[dict[str, Any]], instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    for rule in rules:
        text = rule["rule"]
        if "oldSelf" in text:  # a transition rule: checked on update, against the old object
            continue
        check = CEL_RULES.get(text)
        if check is None:
            yield ValidationError(f"CEL rule not checked offline (add it to CEL_RULES): {text}")
        elif not check(instance):
            yield ValidationError(rule.get("message") or f"fails {text}")


FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@FORMATS.checks("date-time")
def _date_time(value: object) -> bool:
    rfc3339 = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)"
    return not isinstance(value, str) or re.fullmatch(rfc3339, value, re.IGNORECASE) is not None


KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator,
    {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel_rules},
)


@cache
def validator(group: str, kind: str, version: str) -> Any:
    """The validator of ``kind``'s ``version`` schema (the CRD must serve it)."""
    entry = version_entry({"apiVersion": f"{group}/{version}", "kind": kind})
    assert entry is not None and entry["served"], (group, kind, version)
    schema = structural(entry["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    return KubeValidator(schema, format_checker=FORMATS)


def with_defaults(value: Any, schema: dict[str, Any]) -> None:
    """Fill in, in place, the schema's ``default`` of each absent field of ``value``."""
    if isinstance(value, dict):
        named = schema.get("properties", {})
        for name, sub in named.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                with_defaults(value[name], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for name in value.keys() - named.keys():
                with_defaults(value[name], schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            with_defaults(item, schema["items"])


def as_json(doc: Any) -> Any:
    """``doc`` as the API server receives it: YAML made JSON (keys and timestamps as text)."""
    return json.loads(json.dumps(doc, default=lambda v: v.isoformat()))


def field_path(parts: Iterable[str | int]) -> str:
    """Kubernetes' spelling of a field's path: ``spec.groups[0].limits[nvidia.com/gpu]``."""
    out = ""
    for part in parts:
        if isinstance(part, int) or not re.fullmatch(r"[A-Za-z_][-A-Za-z0-9_]*", part):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "<document>"


def _problems_of(error: ValidationError) -> Iterator[Problem]:
    where = list(error.absolute_path)
    if error.validator == "additionalProperties" and error.validator_value is False:
        for name in sorted(set(error.instance) - set(error.schema.get("properties", {}))):
            yield Problem(field_path([*where, name]), "unknown field")
    elif error.validator == "required":
        for name in error.validator_value:
            if name not in error.instance:
                yield Problem(field_path([*where, name]), "required field is missing")
    else:
        yield Problem(field_path(where), error.message)


def problems(doc: dict[str, Any]) -> list[Problem]:
    """What the API server would refuse in ``doc``, a document of a CRD's group
    (:func:`is_custom_resource`), each with its field's path; [] if it takes it."""
    group, version = group_version(doc)
    kind = str(doc.get("kind", ""))
    if (group, kind) not in crds():
        return [Problem("kind", f"no CRD of group {group} defines kind {kind!r}")]
    entry = version_entry(doc)
    if entry is None or not entry["served"]:
        return [Problem("apiVersion", f"{kind} is not served at {doc['apiVersion']}")]
    return check(validator(group, kind, version), doc)


def check(validator: Any, doc: Any) -> list[Problem]:
    """The problems ``validator`` (a :data:`KubeValidator`) finds in ``doc`` once made
    JSON and given its defaults, one each, in the order found."""
    instance = as_json(doc)
    with_defaults(instance, validator.schema)
    found: dict[Problem, None] = {}
    for error in validator.iter_errors(instance):
        found.update(dict.fromkeys(_problems_of(error)))
    return list(found)


# KubeRay's operator refuses a cluster spec (it makes no pods; the resource shows an
# InvalidRayClusterSpec event) for rules of its ray-operator/controllers/ray/utils/
# validation.go. These are the ones a manifest can break on create.
MAX_NAME = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
RAY_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")


CLUSTER_SPEC = {"RayCluster": "spec", "RayJob": "spec.rayClusterSpec"}
CLUSTER_SPEC["RayService"] = "spec.rayClusterConfig"


def operator_problems(doc: dict[str, Any]) -> list[Problem]:
    """What KubeRay's operator refuses in ``doc`` (a RayCluster, RayJob or RayService)."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    found = []
    if len(name) > MAX_NAME[kind] or not re.fullmatch(DNS_1035_LABEL, name):
        found.append(Problem("metadata.name", f"not a DNS-1035 label of {MAX_NAME[kind]} at most"))
    where = CLUSTER_SPEC[kind]
    spec = doc
    for key in where.split("."):
        spec = spec.get(key) or {}
    if not spec:  # a RayJob may run on a cluster it does not make (clusterSelector)
        return found
    found += _group_problems(f"{where}.headGroupSpec", spec["headGroupSpec"])
    autoscaling = spec.get("enableInTreeAutoscaling", False)
    for i, group in enumerate(spec.get("workerGroupSpecs", [])):
        at = f"{where}.workerGroupSpecs[{i}]"
        found += _group_problems(at, group) + _replica_problems(at, group, autoscaling)
    return found


def _group_problems(where: str, group: dict[str, Any]) -> list[Problem]:
    found = []
    params, labels = group.get("rayStartParams", {}), group.get("labels", {})
    if "labels" in params:
        found.append(Problem(f"{where}.rayStartParams.labels", "not supported: use labels"))
    for key, value in labels.items():
        if not re.fullmatch(LABEL_KEY, key) or not re.fullmatch(LABEL_VALUE, value):
            found.append(Problem(f"{where}.labels[{key}]", "not Kubernetes label syntax"))
    if group.get("resources") and any(params.get(k) for k in RAY_START_RESOURCES):
        found.append(Problem(f"{where}.resources", "resources set in rayStartParams as well"))
    if not group["template"]["spec"].get("containers"):
        found.append(Problem(f"{where}.template.spec.containers", "no container"))
    return found


def _replica_problems(where: str, group: dict[str, Any], autoscaling: bool) -> list[Problem]:
    low, high = group.get("minReplicas"), group.get("maxReplicas")
    if low is None or high is None:
        return [] if autoscaling else [Problem(where, "minReplicas or maxReplicas unset")]
    if not 0 <= low <= high:
        return [Problem(where, f"minReplicas {low} and maxReplicas {high} out of order")]
    return []
