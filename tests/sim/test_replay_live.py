"""``pdserve sim-planners --live``: the traffic shift replayed on a real local cluster,
once per planner policy, with the figures of the simulated comparison."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pdserve.bench.report import RequestRecord, Slo
from pdserve.cluster.config import parse_config
from pdserve.deploy.cli import build_parser
from pdserve.sim.replay_live import met_and_arrivals, policy_yaml
from pdserve.sim.replay_report import figures, startup_seen

CONFIG = """\
model: builtin:tiny
connector: shm
engine: {dtype: float32, max_num_batched_tokens: 256}
regions:
  - name: local
    prefill: {count: 1, min: 1, max: 2, num_cpus_per_rank: 0.5}
    decode: {count: 1, min: 1, max: 2, num_cpus_per_rank: 0.5}
slo: {ttft_ms: 1500, tpot_ms: 150}
server: {host: 127.0.0.1, grpc_port: 0, http_port: 0}
auth: {disabled: true}
planner: {mode: "off", interval_s: 2, cooldown_s: 4, idle_s: 6, horizon_s: 4}
"""


def test_a_policy_run_turns_the_planner_on_and_keeps_the_rest() -> None:
    config = parse_config(policy_yaml(CONFIG, "proactive", "/tmp/p.json"))
    assert (config.planner.mode, config.planner.policy) == ("on", "proactive")
    assert config.planner.profile == "/tmp/p.json"
    assert (config.planner.interval_s, config.planner.cooldown_s) == (2, 4)
    assert config.regions[0].role("prefill").max == 2
    reactive = parse_config(policy_yaml(CONFIG, "reactive", None)).planner
    assert (reactive.mode, reactive.policy, reactive.profile) == ("on", "reactive", None)


def _record(index: int, due: float, ttft: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(index, due, due, 100, 8, ok, None if ok else "timeout", 8, ttft, 0.01)


def test_live_requests_give_the_figures_the_simulation_gives() -> None:
    slo = Slo(1.0, 0.1)
    # finished out of order; met: 0 (0.5 s), 2 (0.9 s); missed: 1 (2 s), 3 (failed)
    records = [
        _record(2, 12.0, 0.9),
        _record(0, 1.0, 0.5),
        _record(3, 15.0, 0.2, ok=False),
        _record(1, 5.0, 2.0),
    ]
    met, arrival = met_and_arrivals(records, slo)
    assert met.tolist() == [True, False, True, False]
    assert arrival.tolist() == [1.0, 5.0, 12.0, 15.0]
    counts = [
        {"t_s": 0.0, "local.prefill": 1, "local.decode": 1},
        {"t_s": 10.0, "local.prefill": 1, "local.decode": 1},
        {"t_s": 14.0, "local.prefill": 2, "local.decode": 1},
        {"t_s": 20.0, "local.prefill": 2, "local.decode": 1},
    ]
    decisions = [{"t_s": 4.0, "action": "add_decode"}, {"t_s": 11.0, "action": "add_prefill"}]
    f = figures(met, arrival, counts, decisions, switch_s=10.0)
    assert (f["requests"], f["slo_met"], f["slo_missed"]) == (4, 0.5, 2)
    assert (f["slo_met_after_switch"], f["slo_missed_after_switch"]) == (0.5, 1)
    assert f["first_add_prefill_after_switch_s"] == 1.0
    assert f["more_prefill_serving_after_s"] == 4.0
    assert f["device_s"] == 10 * 2 + 4 * 2 + 6 * 3
    assert f["end_counts"] == {"local.prefill": 2, "local.decode": 1}
    assert f["decisions"] == 2


def test_the_startup_seen_live_is_the_median_delay_from_an_add_to_the_count_rising() -> None:
    counts = [
        {"t_s": float(t), "local.prefill": p, "local.decode": d}
        for t, p, d in [(0, 1, 1), (1, 1, 1), (2, 2, 1), (3, 2, 1), (4, 2, 1), (5, 2, 2)]
    ]
    decisions = [
        {"t_s": 1.5, "action": "add_prefill"},
        {"t_s": 2.5, "action": "add_decode"},
        {"t_s": 4.5, "action": "remove_prefill"},
    ]
    assert startup_seen(counts, decisions) == pytest.approx((0.5 + 2.5) / 2)
    assert startup_seen(counts, decisions[2:]) is None  # no add: the caller's default stands
    assert startup_seen(counts, [{"t_s": 5.5, "action": "add_decode"}]) is None  # never served


@pytest.mark.slow
def test_live_replay_runs_each_policy_on_a_local_cluster(ray_session, tmp_path: Path) -> None:
    config = tmp_path / "shift.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    argv = [
        "sim-planners",
        "--live",
        "--config",
        str(config),
        "--rate",
        "1",
        "--phase-s",
        "8",
        "--max-prompt-len",
        "256",
        "--max-output-len",
        "16",
        "--out",
        str(out),
        "--name",
        "live",
    ]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    payload = json.loads((out / "live.json").read_text())
    assert payload["live"] is True and Path(payload["profile"]).is_file()
    assert (out / "live.png").is_file() and (out / "live-trace.csv").is_file()
    for policy in ("reactive", "proactive"):
        r = payload["policies"][policy]
        assert r["requests"] == r["summary"]["num_requests"] > 8  # both phases were replayed
        assert r["summary"]["num_ok"] == r["requests"], r["summary"]["errors"]
        rows = r["instances_over_time"]
        assert len(rows) >= 8 and rows[0]["local.prefill"] >= 1 and rows[0]["local.decode"] >= 1
        assert all(d["action"] for d in r["planner_decisions"])
        # beside it, the same policy simulated with the live engines' steps, on this host's cores
        sim = r["simulated"]
        assert sim["requests"] == sim["summary"]["num_requests"] == r["requests"]
        assert sim["host_cores"] == len(os.sched_getaffinity(0))
        assert sim["instances_over_time"][0]["local.prefill"] == 1


def test_a_leader_gone_before_the_trace_is_read_gives_no_steps(ray_session) -> None:
    # The planner may remove a traced instance mid-run: the others' steps still come back.
    from ray.exceptions import RayActorError

    from pdserve.core.messages import StepRecord
    from pdserve.sim.live import traced

    @ray_session.remote(num_cpus=0)
    class Leader:
        def step_trace(self, keep: int) -> list[StepRecord]:
            return [] if keep else [StepRecord(1.0, 0.01, (1,), (5,))]

    kept, removed = Leader.remote(), Leader.remote()
    with traced([("prefill0", removed), ("decode1", kept)]) as steps:
        ray_session.kill(removed)  # asynchronous: wait until its calls fail
        for _ in range(300):
            try:
                ray_session.get(removed.step_trace.remote(1))
            except RayActorError:
                break
            time.sleep(0.1)
    assert steps == {"prefill0": [], "decode1": [StepRecord(1.0, 0.01, (1,), (5,))]}
