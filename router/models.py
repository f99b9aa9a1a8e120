"""The models a cluster serves, their versions, and how traffic splits between them.

    resolve(model)   <- a request's ``model`` field: a served model's name, or
                        one of its LoRA adapters (else 404 naming the valid ones)
    pick(name)       <- the version that serves this request: the stable one,
                        or, during a rollout, another by its traffic share

A request is pinned to the version picked when it is admitted: its
tokenizer, its instances (the router's tables are per version) and every
retry or migration stay with that version, so a stream never mixes two. The
one exception keeps a rollout from losing a request: once a version takes no
traffic and its drain outlives ``health.drain_timeout_s``, its requests move to
the version that took its traffic, if that has the same tokenizer
(:meth:`ModelCatalog.heir`); their chunks still name the version they began on.

A model's LoRA adapters are named at start-up and loaded or unloaded at
runtime (:meth:`ModelCatalog.add_adapter`, from ``router/lora_admin.py``).

Each version has a deployment key: ``""`` for the cluster's own ``model``
(the key every instance of a one-model cluster carries), ``name@version``
for every other. The controller adds a version when its instances are up,
shifts traffic (canary, promote, rollback, blue/green) with
:meth:`ModelCatalog.set_traffic`, and removes a version once its instances
are drained.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.core.adapters import UnknownAdapterError
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedVersion:
    """One version of a model: what the front doors need to take its requests."""

    name: str
    version: str
    key: str  # the deployment key its instances register with
    tokenizer: Tokenizer | None
    vocab_size: int
    adapters: tuple[str, ...] = ()

    @classmethod
    def load(
        cls, name: str, version: str, key: str, path: str, adapters: tuple[str, ...] = ()
    ) -> ServedVersion:
        """Its tokenizer and vocabulary, read from the model folder at ``path``."""
        model = ModelConfig.from_dir(path)
        has_tokenizer = (Path(path) / "tokenizer.json").is_file()
        tokenizer = Tokenizer.from_dir(path) if has_tokenizer else None
        return cls(name, version, key, tokenizer, model.vocab_size, adapters)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


Served = tuple[ServedVersion, str | None]  # a request's version and LoRA adapter (None: base)


@dataclass
class ServedModel:
    """A model name and its versions; ``traffic`` is each version's share (sums to 1)."""

    name: str
    versions: dict[str, ServedVersion] = field(default_factory=dict)
    traffic: dict[str, float] = field(default_factory=dict)

    @property
    def stable(self) -> str:
        """The version with the largest share; on a tie, the one served longest."""
        order = list(self.versions)
        return max(order, key=lambda v: (self.traffic.get(v, 0.0), -order.index(v)))


class ModelCatalog:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.models: dict[str, ServedModel] = {}
        self.rng = rng or random.Random()

    def add(self, version: ServedVersion, share: float | None = None) -> None:
        """Serve ``version``: its model's only version gets all traffic; a further
        version gets ``share`` (default 0) until :meth:`set_traffic` moves it."""
        model = self.models.setdefault(version.name, ServedModel(version.name))
        if version.version in model.versions:
            raise InvalidArgumentError(
                "version", f"{version.label} is served already; versions are immutable"
            )
        model.versions[version.version] = version
        if len(model.versions) == 1:
            model.traffic = {version.version: 1.0}
        else:
            self.set_traffic(version.name, {**model.traffic, version.version: share or 0.0})

    def remove(self, name: str, version: str) -> None:
        """Stop serving ``name@version`` (its share must be 0 by now)."""
        model = self._model(name)
        if model.traffic.get(version, 0.0) > 0 and len(model.versions) > 1:
            raise InvalidArgumentError("version", f"{name}@{version} still takes traffic")
        model.versions.pop(version, None)
        model.traffic.pop(version, None)
        if not model.versions:
            del self.models[name]

    def set_traffic(self, name: str, shares: dict[str, float]) -> None:
        """Each version's share of ``name``'s new requests (normalised; every served
        version not named gets 0)."""
        model = self._model(name)
        for version, share in shares.items():
            if version not in model.versions:
                raise InvalidArgumentError(
                    "version",
                    f"{name} has no version {version!r}; served: {sorted(model.versions)}",
                )
            if share < 0:
                raise InvalidArgumentError("traffic", f"a share must be >= 0, got {share}")
        total = sum(shares.values())
        if total <= 0:
            raise InvalidArgumentError("traffic", "at least one version must take traffic")
        model.traffic = {v: shares.get(v, 0.0) / total for v in model.versions}

    def add_adapter(self, name: str, adapter: str) -> None:
        """Model ``name``'s versions serve LoRA adapter ``adapter`` too (a runtime load)."""
        model = self._model(name)
        for key, v in model.versions.items():
            if adapter not in v.adapters:
                model.versions[key] = replace(v, adapters=(*v.adapters, adapter))

    def remove_adapter(self, name: str, adapter: str) -> None:
        """Model ``name`` no longer serves ``adapter``: requests naming it get 404."""
        model = self._model(name)
        for key, v in model.versions.items():
            model.versions[key] = replace(v, adapters=tuple(a for a in v.adapters if a != adapter))

    def resolve(self, model: object) -> tuple[str, str | None]:
        """(model name, LoRA adapter or None) for a request's ``model`` field."""
        if isinstance(model, str):
            if model in self.models:
                return model, None
            for served in self.models.values():
                if any(model in v.adapters for v in served.versions.values()):
                    return served.name, model
        raise UnknownAdapterError(str(model)[:128], tuple(self.names()[1:]), base=self.default)

    def pick(self, name: str) -> ServedVersion:
        """The version this request of ``name`` goes to, by the traffic shares."""
        model = self._model(name)
        draw = self.rng.random()
        for version, share in model.traffic.items():
            draw -= share
            if draw < 0 and share > 0:
                return model.versions[version]
        return model.versions[model.stable]

    def names(self) -> list[str]:
        """Every name a request may give: models first, then their adapters."""
        adapters = [
            a for m in self.models.values() for v in m.versions.values() for a in v.adapters
        ]
        return list(self.models) + list(dict.fromkeys(adapters))

    @property
    def default(self) -> str | None:
        return next(iter(self.models), None)

    def by_key(self, key: str) -> ServedVersion | None:
        for model in self.models.values():
            for version in model.versions.values():
                if version.key == key:
                    return version
        return None

    def heir(self, key: str) -> ServedVersion | None:
        """The version that carries on the requests pinned to deployment key ``key``
        once a rollout took all its traffic away (they move when its drain times
        out): its model's stable version, when that is another version that takes
        traffic and has the same tokenizer, so a stream's tokens mean the same; None
        while ``key`` takes traffic itself, or when no version can carry on."""
        for model in self.models.values():
            for version, served in model.versions.items():
                if served.key != key:
                    continue
                stable = model.versions[model.stable]
                if model.traffic.get(version, 0.0) > 0 or model.traffic[model.stable] <= 0:
                    return None
                return stable if _same_tokens(served, stable) else None
        return None

    def _model(self, name: str) -> ServedModel:
        if name not in self.models:
            served = list(self.models)
            raise InvalidArgumentError("model", f"unknown model {name!r}; served: {served}")
        return self.models[name]


def _same_tokens(a: ServedVersion, b: ServedVersion) -> bool:
    """Whether token ids mean the same text in both versions."""
    if a.vocab_size != b.vocab_size:
        return False
    if a.tokenizer is None or b.tokenizer is None:
        return a.tokenizer is b.tokenizer
    return bool(a.tokenizer.hf.to_str() == b.tokenizer.hf.to_str())


@dataclass(frozen=True)
class VersionHealth:
    """A version's recent requests: how many, the share that failed, its p90 latencies."""

    requests: int
    error_rate: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None


class VersionOutcomes:
    """The last ``window`` outcomes of each deployment key (what a canary is judged by)."""

    def __init__(self, window: int = 512) -> None:
        self.window = window
        self.outcomes: dict[str, deque[tuple[bool, float | None, float | None]]] = {}

    def record(self, key: str, ok: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        self.outcomes.setdefault(key, deque(maxlen=self.window)).append((ok, ttft_s, tpot_s))

    def health(self, key: str) -> VersionHealth:
        seen = list(self.outcomes.get(key, ()))
        ttft = [t for _, t, _ in seen if t is not None]
        tpot = [t for _, _, t in seen if t is not None]
        return VersionHealth(
            len(seen),
            sum(not ok for ok, _, _ in seen) / len(seen) if seen else 0.0,
            _p90(ttft),
            _p90(tpot),
        )

    def forget(self, key: str) -> None:
        self.outcomes.pop(key, None)


def _p90(values: list[float]) -> float | None:
    return sorted(values)[min(len(values) - 1, int(0.9 * len(values)))] if values else None
