"""Step-time noise: how far a live step lands from its model, and for how long.

The same batch does not take the same time twice on a live host. On the 2-vCPU
VM of ``docs/results/simulator.md`` a serving instance's loop turns spread around the
calibrated model with a standard deviation of 0.10-0.24 in log, and the
deviations persist: consecutive steps' lag-1 correlation was 0.3-0.7 (the host's
other work comes in episodes). A model without that noise times identical
requests identically, so a simulated closed loop of equal requests settles into
one rhythm and its p90 equals its p50, where the live one's p90 was 14-34% above.

:class:`Jitter` draws each step's factor from an Ornstein-Uhlenbeck process in
log time, one per instance: stationary spread ``sigma``, correlation decaying
as ``exp(-dt / corr_s)`` over ``dt`` seconds between step starts (the steps'
times without the noise), and mean 1, so
the model's mean time stands. :func:`fit_jitter` measures both from traced
steps against the model that times them. A profile carries them on its
:class:`~pdserve.sim.profile.StepModel` (``jitter``, ``jitter_s``); 0, as in a
profile of steps timed back to back, is no noise, and the simulation is
deterministic either way (each instance's draws are seeded by its id).
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence

import numpy as np

MIN_STEPS = 8  # fit_jitter: a trace of fewer steps tells nothing about its spread


class Jitter:
    """One instance's step-time factors (module docstring): ``factor(elapsed)`` at each
    step's start."""

    def __init__(self, sigma: float, corr_s: float, key: str) -> None:
        self.sigma, self.corr_s = sigma, corr_s
        self._shift = sigma * sigma / 2  # exp(x - sigma^2 / 2) has mean 1
        self._rng = random.Random(zlib.crc32(key.encode()))
        self._x = self._rng.gauss(0.0, sigma) if sigma else 0.0  # stationary from the start

    def factor(self, elapsed: float) -> float:
        """The factor of a step that starts ``elapsed`` seconds after the last one
        started (1 without noise). ``elapsed`` is to be the last step's time without
        its factor, plus any idle time after it: measured on the noisy clock, a slow
        step would space the draws wider than a fast one, the process would revert
        sooner from slow draws than from fast ones, and the steps would come out
        faster than the model on average."""
        if not self.sigma:
            return 1.0
        keep = math.exp(-elapsed / self.corr_s) if self.corr_s > 0 else 0.0
        fresh = math.sqrt(max(0.0, 1.0 - keep * keep))
        self._x = keep * self._x + fresh * self._rng.gauss(0.0, self.sigma)
        return math.exp(self._x - self._shift)


def fit_jitter(starts: Sequence[np.ndarray], ratios: Sequence[np.ndarray]) -> tuple[float, float]:
    """(``sigma``, ``corr_s``) of traced steps: per trace (one instance's steps in
    order), each step's start and its live time over the model's. Each trace's
    logs are taken about their own mean (a run's level is the calibration's and
    the host check's to set, not noise), the spread pooled over the traces, and the
    lag-1 correlation of consecutive steps turned into a time through the traces'
    median gap between step starts. Too few steps: no noise, (0, 0)."""
    devs, lagged, gaps = [], [], []
    for start, ratio in zip(starts, ratios, strict=True):
        if len(ratio) < MIN_STEPS or not (np.isfinite(ratio) & (ratio > 0)).all():
            continue  # too short, or a step the model gives no time (nothing to compare)
        d = np.log(ratio) - np.log(ratio).mean()
        devs.append(d)
        lagged.append(np.column_stack([d[:-1], d[1:]]))
        gaps.append(np.diff(start))
    if not devs:
        return 0.0, 0.0
    d = np.concatenate(devs)
    sigma = float(np.sqrt(np.mean(d * d)))
    pairs = np.concatenate(lagged)
    rho = float(np.mean(pairs[:, 0] * pairs[:, 1]) / (sigma * sigma)) if sigma else 0.0
    gap = float(np.median(np.concatenate(gaps)))
    if not (0.0 < rho < 1.0) or gap <= 0:
        return sigma, 0.0
    return sigma, -gap / math.log(rho)
