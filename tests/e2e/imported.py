"""Which modules a Ray actor's process has imported: what Ray loaded there with the
classes of the handles it holds. This module imports nothing of pdserve, so asking
loads nothing more in the actor (Ray imports a called function's module there)."""

from __future__ import annotations

import ray


def imported(actor, names: tuple[str, ...]) -> list[str]:  # type: ignore[no-untyped-def]
    """Which of the modules ``names`` the process of ``actor`` (an actor's handle) holds."""
    return ray.get(actor.__ray_call__.remote(_imported, names))


def _imported(_actor: object, names: tuple[str, ...]) -> list[str]:
    import sys

    return sorted(n for n in names if n in sys.modules)
