"""Whether Triton itself can run kernels on a device, for test modules that skip if not.

A test module sets ``TRITON_INTERPRET`` (on CPU) before importing this, then
skips at module level when :func:`triton_problem` returns a reason: a missing
Triton, or one that cannot launch a kernel, is a skip; a failure of pdserve's
kernels is a failure.
"""

from __future__ import annotations

import torch


def triton_problem(device: torch.device) -> str | None:
    """Why Triton itself cannot run on ``device`` (not our kernels), or None."""
    try:
        from pdserve.kernels.support import launch_check, runs_on
    except ImportError as e:
        return f"Triton is not installed: {e}"
    if not runs_on(device):
        return f"Triton kernels cannot run on {device} (TRITON_INTERPRET set too late?)"
    try:
        launch_check(device)
    except Exception as e:  # no driver, no compiler, a broken install: skip, not fail
        return f"Triton cannot launch a kernel on {device}: {type(e).__name__}: {e}"
    return None
