"""The router's catalog of models and versions, and how a canary is judged."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.cluster.config_models import RolloutConfig
from pdserve.cluster.fleet import judge
from pdserve.core.adapters import UnknownAdapterError
from pdserve.core.errors import InvalidArgumentError
from pdserve.router.models import ModelCatalog, ServedVersion, VersionHealth, VersionOutcomes


def version(name: str, v: str, adapters: tuple[str, ...] = ()) -> ServedVersion:
    return ServedVersion(name, v, "" if v == "v1" else f"{name}@{v}", None, 100, adapters)


def test_names_resolve_to_models_and_adapters_and_unknown_ones_list_the_valid() -> None:
    catalog = ModelCatalog()
    catalog.add(version("tiny", "v1", ("sql",)))
    catalog.add(ServedVersion("code", "v3", "code@v3", None, 50))
    assert catalog.names() == ["tiny", "code", "sql"]
    assert catalog.resolve("tiny") == ("tiny", None)
    assert catalog.resolve("sql") == ("tiny", "sql")
    assert catalog.resolve("code") == ("code", None)
    assert catalog.pick("code").key == "code@v3"  # a new model takes all of its traffic
    with pytest.raises(UnknownAdapterError) as e:
        catalog.resolve("nope")
    assert all(n in str(e.value) for n in ("'nope'", "tiny", "code", "sql"))


def test_traffic_splits_by_share_and_a_version_is_immutable() -> None:
    catalog = ModelCatalog(random.Random(0))
    catalog.add(version("tiny", "v1"))
    catalog.add(version("tiny", "v2"))  # no traffic until it is given some
    assert {catalog.pick("tiny").version for _ in range(200)} == {"v1"}
    catalog.set_traffic("tiny", {"v1": 0.75, "v2": 0.25})
    picks = Counter(catalog.pick("tiny").version for _ in range(4000))
    assert 0.22 < picks["v2"] / 4000 < 0.28, picks
    assert catalog.models["tiny"].stable == "v1"
    with pytest.raises(InvalidArgumentError, match="immutable"):
        catalog.add(version("tiny", "v2"))
    with pytest.raises(InvalidArgumentError, match="still takes traffic"):
        catalog.remove("tiny", "v2")
    with pytest.raises(InvalidArgumentError, match="no version 'v9'"):
        catalog.set_traffic("tiny", {"v9": 1.0})
    catalog.set_traffic("tiny", {"v2": 1.0})
    assert catalog.models["tiny"].stable == "v2"
    catalog.remove("tiny", "v1")
    assert {catalog.pick("tiny").version for _ in range(50)} == {"v2"}


def test_a_retired_versions_requests_carry_on_on_the_version_that_took_its_traffic() -> None:
    catalog = ModelCatalog()
    catalog.add(version("tiny", "v1"))
    catalog.add(version("tiny", "v2"))
    catalog.add(ServedVersion("tiny", "v3", "tiny@v3", None, 99))  # another vocabulary
    catalog.set_traffic("tiny", {"v1": 0.9, "v2": 0.1})  # a canary
    assert catalog.heir("") is None and catalog.heir("tiny@v2") is None  # both take traffic
    catalog.set_traffic("tiny", {"v2": 1.0})  # promoted: v1 retires
    assert catalog.heir("").key == "tiny@v2"
    assert catalog.heir("tiny@v2") is None
    catalog.set_traffic("tiny", {"v3": 1.0})  # its tokens would mean other text
    assert catalog.heir("tiny@v2") is None and catalog.heir("nope@v1") is None


def test_outcomes_give_error_rate_and_p90s() -> None:
    outcomes = VersionOutcomes(window=100)
    for i in range(10):
        outcomes.record("a@v2", i != 0, 0.1 * (i + 1), 0.01)
    h = outcomes.health("a@v2")
    assert h.requests == 10 and h.error_rate == pytest.approx(0.1)
    assert h.ttft_p90_s == pytest.approx(1.0) and h.tpot_p90_s == pytest.approx(0.01)
    assert outcomes.health("other").requests == 0


@pytest.mark.parametrize(
    ("canary", "verdict"),
    [
        (VersionHealth(5, 0.5, 9.0, 9.0), None),  # too few requests to judge
        (VersionHealth(30, 0.02, 0.11, 0.011), None),  # as good
        (VersionHealth(30, 0.10, 0.11, 0.011), "error rate"),
        (VersionHealth(30, 0.02, 0.20, 0.011), "TTFT p90"),
        (VersionHealth(30, 0.02, 0.11, 0.030), "TPOT p90"),
    ],
)
def test_a_canary_is_rolled_back_when_it_regresses(
    canary: VersionHealth, verdict: str | None
) -> None:
    stable = VersionHealth(100, 0.01, 0.10, 0.010)
    reason = judge(stable, canary, RolloutConfig(min_requests=20))
    assert (reason is None) if verdict is None else (reason is not None and verdict in reason)
