"""The textbook capacity plan every operator knows, from the same latency model.

Prefill as an M/D/1 queue per instance: service time ``S`` (one prompt, one
step), mean wait ``W = rho S / (2 (1 - rho))``; the safe utilisation is the
highest ``rho`` with ``W + S <= TTFT SLO``, so instances = ``lambda S / rho``.
Decode as a batch server: the largest batch ``B`` whose step time meets the
TPOT SLO and whose KV fits the cache serves ``B / step(B)`` tokens a second;
instances = ``lambda x output tokens / that``. Both are then grown by the
headroom (+30%) and one spare (N+1). Means, not percentiles, and no
interference between requests: that is what the simulator adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.sim.profile import Profile, StepFeatures


@dataclass(frozen=True)
class SingleInstance:
    """What one instance of a layout does with one request of the mix, alone and full."""

    prefill_s: float  # one prompt in one step: the TTFT floor
    decode_floor_s: float  # one decode step at batch 1: weights (and overhead) only
    bandwidth_floor_s: float  # weights / memory bandwidth at 100%: the physical floor
    max_batch: int  # sequences of prompt + output tokens the KV cache holds
    batch: int  # the largest batch meeting the TPOT SLO (and the KV and max_num_seqs)
    step_at_batch_s: float  # decode step time at ``batch``


def single_instance(
    prefill: Profile,
    decode: Profile,
    prompt: float,
    output: float,
    tpot_slo_s: float,
    max_num_seqs: int,
    peak_bw: float,
    kv_tokens: int | None = None,
) -> SingleInstance:
    """``kv_tokens``: the decode KV cache when the config sets it (else the profile's)."""
    prefill_s = prefill.step.time(StepFeatures.of([(round(prompt), 0)]))
    ctx = round(prompt + output / 2)  # mean context over a request's decode
    step = decode.step
    per_seq_tokens = prompt + output
    kv = decode.kv_capacity_tokens if kv_tokens is None else kv_tokens
    max_batch = max(0, int(kv // per_seq_tokens))
    batch, at = 0, 0.0
    for b in range(1, min(max_batch, max_num_seqs) + 1):
        t = step.time(StepFeatures.of([(1, ctx)] * b))
        if t > tpot_slo_s:
            break
        batch, at = b, t
    floor = step.time(StepFeatures.of([(1, 0)]))
    elem = 4 if decode.dtype == "float32" else 2
    bw_floor = decode.model.params * elem / (peak_bw * decode.devices)
    return SingleInstance(prefill_s, floor, bw_floor, max_batch, batch, at)


@dataclass(frozen=True)
class TextbookPlan:
    prefill_rho: float
    prefill_rate: float  # requests/s one prefill instance serves at 100%
    decode_rate: float  # requests/s one decode instance serves at its SLO batch
    prefill: int
    decode: int
    prefill_bare: int  # before headroom and N+1
    decode_bare: int


def safe_utilisation(
    service_s: float, ttft_slo_s: float, arrival_cv2: float = 1.0, tail: float = 1.0
) -> float:
    """Largest utilisation whose wait + service meets the TTFT SLO (0: none).

    The wait is Kingman's G/D/1 approximation ``W = cv2 rho S / (2 (1 - rho))``
    (M/D/1 for Poisson arrivals, ``cv2 = 1``); ``tail`` > 1 plans for a
    percentile rather than the mean (the wait's p90 is ~2.3 x its mean when its
    tail is exponential).
    """
    slack = (ttft_slo_s - service_s) / tail
    if slack <= 0:
        return 0.0
    return 2 * slack / (arrival_cv2 * service_s + 2 * slack)


def textbook_plan(
    rate: float,
    one: SingleInstance,
    output: float,
    ttft_slo_s: float,
    headroom: float,
    spares: int,
    arrival_cv2: float = 1.0,
    tail: float = 1.0,
) -> TextbookPlan:
    rho = safe_utilisation(one.prefill_s, ttft_slo_s, arrival_cv2, tail)
    mu_p = 1.0 / one.prefill_s
    mu_d = one.batch / (one.step_at_batch_s * output) if one.batch else 0.0
    bare_p = math.ceil(rate / (rho * mu_p)) if rho > 0 else 0
    bare_d = math.ceil(rate / mu_d) if mu_d > 0 else 0
    grown_p = math.ceil(rate * (1 + headroom) / (rho * mu_p)) + spares if rho > 0 else 0
    grown_d = math.ceil(rate * (1 + headroom) / mu_d) + spares if mu_d > 0 else 0
    return TextbookPlan(rho, mu_p, mu_d, grown_p, grown_d, bare_p, bare_d)
