"""How a simulation runs and what it measured: :class:`SimOptions`, :class:`SimRun`.

Also :func:`long_lived_heap`, which a run holds while it lasts: the simulator
keeps millions of long-lived objects (KV blocks, requests and their token
lists) and frees what it drops by reference counting alone (it makes no
reference cycles per request; ``tests/sim`` checks it), so the cyclic
collector, which would traverse every new object and its lists again and
again (a third of the CPU at 1,000 instances), is paused for the run and
restored when the run ends.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from pdserve.sim.instance import SimInstance
    from pdserve.sim.results import Recorder


@dataclass(frozen=True)
class SimOptions:
    """How the simulator runs (the cluster itself comes from the YAML).

    Attributes:
        fast: jump over runs of decode steps whose batch cannot change.
        keep_itl: keep every per-token gap (for ITL percentiles; memory grows with tokens).
        startup_s: seconds from a planner's add decision to the instance serving.
        planner: run the config's planner (its mode decides whether it applies changes).
        request_overhead_s: a request's fixed cost outside the engines' steps (front
            door, router, RPCs, the first token's way back), added to its TTFT.
        request_jitter: that cost's spread, the standard deviation of its log (each
            request's drawn apart, with mean 1; :mod:`~pdserve.sim.jitter`).
        noise_seed: which draws of the steps' and requests' noise the run takes
            (the same seed, the same run).
        one_host: every instance shares one host, as a local cluster does (a step
            beside another instance's step takes the step model's shared time).
        host_cores: every instance shares a host of this many cores (0: each has
            devices of its own, as on GPUs). A step runs as many times slower as
            the busy instances' threads exceed the cores, re-timed whenever one of
            their steps starts or ends (processor sharing), step by step: on a
            local cluster of a few cores an added instance adds queues, not compute.
        max_concurrency: most requests in flight, as ``pdserve bench serve
            --max-concurrency`` sends them (None: an open loop); see :mod:`~pdserve.sim.gate`.
        request_timeout_s: a request still in flight this long after it was sent fails
            and is aborted, as ``--request-timeout`` (None: never); see
            :mod:`~pdserve.sim.timeouts`.
    """

    fast: bool = True
    keep_itl: bool = True
    startup_s: float = 30.0
    planner: bool = True
    request_overhead_s: float = 0.0
    request_jitter: float = 0.0
    noise_seed: int = 0
    one_host: bool = False
    host_cores: float = 0.0
    max_concurrency: int | None = None
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidArgumentError(
                "max_concurrency", f"must be >= 1, got {self.max_concurrency}"
            )
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise InvalidArgumentError(
                "request_timeout", f"must be > 0, got {self.request_timeout_s}"
            )
        if not 0 <= self.startup_s < math.inf:
            raise InvalidArgumentError("startup_s", f"must be >= 0, got {self.startup_s}")
        if not 0 <= self.request_jitter < math.inf:
            raise InvalidArgumentError("request_jitter", f"must be >= 0, got {self.request_jitter}")
        if not self.host_cores >= 0:
            raise InvalidArgumentError("host_cores", f"must be >= 0, got {self.host_cores}")


@dataclass
class SimRun:
    """Everything a finished run measured."""

    recorder: Recorder
    regions: list[str]
    instances: list[SimInstance]  # every instance that ever ran
    counts: list[dict[str, Any]] = field(default_factory=list)  # instance counts over time
    decisions: list[dict[str, Any]] = field(default_factory=list)
    end_s: float = 0.0
    events: int = 0
    tallies: list[Any] | None = None  # a merged run's instance tallies (sim/sharded.py)
    shards: dict[str, Any] | None = None  # a merged run's shards and their costs


@contextmanager
def long_lived_heap() -> Iterator[None]:
    """Pause the cyclic garbage collector while the block runs (as it was after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def calibrated_options(profiles: list[Any]) -> dict[str, Any]:
    """What calibrated profiles (``pdserve profile --config``, ``pdserve sim-validate --write-profiles``) add to a
    run: a request's overhead and its noise, and every instance on one host."""
    return {
        "request_overhead_s": max((p.request_overhead_s for p in profiles), default=0.0),
        "request_jitter": max((p.request_jitter for p in profiles), default=0.0),
        "one_host": any(p.one_host for p in profiles),
    }
