"""What an elastic-EP leader reports of its recoveries (``elastic_status``).

Light on purpose (no torch): the controller reads it in its health checks
(:mod:`pdserve.cluster.elastic_ep`) without the rank's code; the recovery itself is
:mod:`pdserve.parallel.elastic`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recovery:
    """One lost rank recovered from; times are wall-clock (``time.time()``) or seconds."""

    dead: tuple[int, ...]  # the ranks lost (as numbered at start)
    members: tuple[int, ...]  # the ranks serving after (as numbered at start)
    failed_at: float  # when the leader's collective raised
    identify_s: float
    regroup_s: float  # every survivor in its new groups (the slowest)
    reload_s: float  # every survivor's experts placed (the slowest)
    resumed_at: float = 0.0  # when the failed step's re-run returned its tokens
    copied_slots: int = 0
    loaded_slots: int = 0


@dataclass(frozen=True)
class ElasticStatus:
    """What the leader's ``elastic_status`` answers."""

    members: tuple[int, ...]  # ranks serving (as numbered at start)
    steps: int  # steps the leader ran
    recoveries: tuple[Recovery, ...]
