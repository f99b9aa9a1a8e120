"""Engine and router settings given from Python (``LLM(...)``, ``EngineConfig``) refuse
NaN and infinity where they are times: a NaN passes a "> 0" check, and a lease whose
deadline is NaN never expires."""

from __future__ import annotations

import math

import pytest

from pdserve.core.config import DisaggregationConfig, ParallelConfig
from pdserve.core.errors import InvalidArgumentError


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0])
def test_a_reservation_lease_is_finite(bad: float) -> None:
    with pytest.raises(InvalidArgumentError, match="reservation_ttl_s: must be > 0 and finite"):
        DisaggregationConfig(reservation_ttl_s=bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_the_expert_rebalance_interval_is_finite(bad: float) -> None:
    with pytest.raises(InvalidArgumentError, match="rebalance_interval_s: must be >= 0 and finite"):
        ParallelConfig(rebalance_interval_s=bad)
