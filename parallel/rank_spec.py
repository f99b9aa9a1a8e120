"""What a rank is built from and what crosses its actor's boundary at start-up.

Light on purpose (no torch): the process that starts an instance's ranks (the
cluster's controller, ``pdserve serve``) builds these and reads them back without
importing the rank's code (:mod:`pdserve.parallel.worker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.config import EngineConfig
from pdserve.core.env import env_switch
from pdserve.core.layout import Layout
from pdserve.core.model_config import ModelConfig
from pdserve.core.sampling_params import SamplingParams

SHM_COLLECTIVES_ENV = "PDSERVE_SHM_COLLECTIVES"  # "0" keeps every group on gloo


def shm_enabled_by_env() -> bool:
    """False when ``PDSERVE_SHM_COLLECTIVES`` is ``0``, ``false``, ``no`` or ``off``."""
    return env_switch(SHM_COLLECTIVES_ENV)


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank is built from."""

    rank: int
    layout: Layout
    model: ModelConfig
    engine: EngineConfig
    collective_timeout_s: float = 60.0
    torch_threads: int = 1
    # Shared-memory collectives (pdserve.distributed.shm_comm) for groups on one host;
    # read from PDSERVE_SHM_COLLECTIVES where the spec is built (the driver).
    shm_collectives: bool = field(default_factory=shm_enabled_by_env)


@dataclass(frozen=True)
class EngineInfo:
    num_kv_blocks: int
    max_model_len: int
    block_size: int


@dataclass(frozen=True)
class GenerateItem:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
