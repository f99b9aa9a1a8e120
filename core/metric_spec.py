"""What a metric of the catalog is (:mod:`pdserve.core.metrics`): name, kind, help, labels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

# Latency buckets (seconds): 1 ms .. 60 s, denser where SLOs usually sit (a row under a
# second, a row from one second up).
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75),
    *(1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0),
)
TOKEN_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15),
    *(0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0),
)

PHASES = ("prefill_queue", "prefill", "transfer", "decode_queue", "decode")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    source: Literal["router", "instance", "controller"] = "router"


INSTANCE_LABELS = ("region", "role", "instance")
