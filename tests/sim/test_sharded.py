"""``pdserve sim --workers``: a fleet sharded over worker processes against one process.

Where nothing crosses shards (regions too far apart for a request to be sent away)
every request's record is the one-process run's, ITL samples included. Where
requests cross (spill-over between regions 50 ms apart) or a region is split into
instance groups, the shards' routers see less (another shard's region as it was
up to one window ago; only their own group), so latencies agree within a
tolerance: TPOT p50/p90/p99 within 2%, TTFT p50 within 5% and p90 within 15%.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.report import Slo
from pdserve.cluster.config import parse_config
from pdserve.deploy.cli import main
from pdserve.sim.build import book_for
from pdserve.sim.cluster import SimCluster
from pdserve.sim.flags import DeviceFlags, assumptions_from
from pdserve.sim.options import SimOptions, SimRun
from pdserve.sim.report import per_role
from pdserve.sim.sharded import run_sharded
from pdserve.sim.shards import plan_shards
from pdserve.sim.workload import SimWorkload

FLEET_50 = Path(__file__).resolve().parents[2] / "sim" / "configs" / "fleet-50.yaml"
ENGINE = "engine: {max_num_seqs: 256, max_num_batched_tokens: 8192, enable_prefix_caching: false}"


def _regions(latency_ms: int, a: tuple[int, int], b: tuple[int, int]) -> str:
    """Two regions ``latency_ms`` apart of (prefill, decode) H100 instances each."""
    return (
        f"model: llama-7b\nconnector: p2p\n{ENGINE}\nregions:\n"
        f"  - name: a\n    latency_ms: {{b: {latency_ms}}}\n"
        f"    prefill: {{count: {a[0]}, min: 1, max: 30}}\n"
        f"    decode: {{count: {a[1]}, min: 1, max: 70}}\n"
        f"  - name: b\n    latency_ms: {{a: {latency_ms}}}\n"
        f"    prefill: {{count: {b[0]}, min: 1, max: 30}}\n"
        f"    decode: {{count: {b[1]}, min: 1, max: 70}}\n"
        "slo: {ttft_ms: 1000, tpot_ms: 50}\nrouter: {max_inflight_per_region: 100000}\n"
        "planner: {mode: advisory, interval_s: 10}\n"
    )


def _work(n: int, rate: float, shares: list[float], seed: int = 0) -> SimWorkload:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    prompt = np.clip(rng.normal(1000, 300, n), 1, None).astype(np.int64)
    output = np.clip(rng.normal(256, 100, n), 1, None).astype(np.int64)
    p = np.array(shares) / sum(shares)
    home = rng.choice(len(shares), size=n, p=p).astype(np.int16)
    return SimWorkload(arrival, prompt, output, home)


def _both(yaml: str, work: SimWorkload, workers: int) -> tuple[SimRun, SimRun]:
    config = parse_config(yaml)
    book = book_for(config, [], "h100", assumptions_from(DeviceFlags(), None))
    options = SimOptions(request_timeout_s=600.0)
    one = SimCluster(config, book, work, options).run()
    return one, run_sharded(config, book, work, options, workers)


def _ms(run: SimRun) -> dict[str, np.ndarray]:
    rec = run.recorder
    ok = rec.done & (rec.error == 0)
    n = rec.tokens[ok].astype(np.float64)
    many = n > 1
    tpot = (rec.end - rec.first)[ok][many] / (n[many] - 1)
    q = [50, 90, 99]
    return {"ttft": np.percentile((rec.first - rec.sent)[ok], q), "tpot": np.percentile(tpot, q)}


def test_where_nothing_crosses_shards_every_record_is_the_one_process_runs() -> None:
    one, sharded = _both(_regions(500, (3, 7), (3, 7)), _work(1500, 60, [1, 1]), 2)
    a, b = one.recorder, sharded.recorder
    assert (a.region == a.home).all()  # nothing crossed
    for name in ("first", "end", "tokens", "error", "region", "done"):
        assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True), name
    assert a.itl == b.itl
    assert sharded.end_s == one.end_s
    assert a.summary(_slo()) == b.summary(_slo())
    assert sum(r["instances"] for r in _per_role(sharded)) == 20


def test_spill_over_between_shards_stays_within_the_tolerance() -> None:
    one, sharded = _both(_regions(50, (1, 2), (4, 10)), _work(1500, 40, [3, 1]), 2)
    spilled = [int((r.recorder.region != r.recorder.home).sum()) for r in (one, sharded)]
    assert min(spilled) > 100  # many requests crossed in both runs
    _within(_ms(one), _ms(sharded))
    assert sharded.recorder.done.all()


def test_a_region_split_into_groups_stays_within_the_tolerance() -> None:
    config = parse_config(_regions(500, (8, 18), (1, 1)))
    work = _work(2000, 120, [1, 0])
    assert [len(s.cells) for s in plan_shards(config, work, 3)] == [1, 1, 1]  # a: 2 groups
    one, sharded = _both(_regions(500, (8, 18), (1, 1)), work, 3)
    _within(_ms(one), _ms(sharded))


def test_workers_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    for n in ("0", "-1"):
        rc = main(["sim", "--config", str(FLEET_50), "--device", "h100", "--workers", n])
        assert rc == 2
        err = capsys.readouterr().err
        assert f"--workers must be at least 1, got {n}" in err
        assert "Traceback" not in err


def _within(one: dict[str, np.ndarray], sharded: dict[str, np.ndarray]) -> None:
    rel = {k: np.abs(sharded[k] - one[k]) / one[k] for k in one}
    assert (rel["tpot"] <= 0.02).all(), rel
    assert rel["ttft"][0] <= 0.05 and rel["ttft"][1] <= 0.15, rel


def _slo() -> Slo:
    return Slo(1.0, 0.05)


def _per_role(run: SimRun) -> list[dict[str, int]]:
    return list(per_role(run.tallies or [], run.end_s).values())
