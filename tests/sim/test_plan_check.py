"""``pdserve plan --check``: the recommended plan served here against what it promised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cluster.config import parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cli import main
from pdserve.sim.analytic import model_shape
from pdserve.sim.plan_check import PROMISE_MARGIN, PlanCheck, checkable, local_yaml
from pdserve.sim.profile import TransferModel, save_profile
from tests.sim.helpers import TINY_STEP, cpu_profile

PLAN_YAML = (
    "model: builtin:tiny\n"
    "engine: {max_num_seqs: 64, max_num_batched_tokens: 512, block_size: 16}\n"
    "regions:\n  - name: local\n"
    "    prefill: {count: 1, min: 1, max: 1, tensor_parallel_size: 1}\n"
    "    decode: {count: 1, min: 1, max: 1, tensor_parallel_size: 1}\n"
    "slo: {ttft_ms: 200, tpot_ms: 20}\n"
    'planner: {mode: "off"}\n'
)


def _tiny_profile(tmp_path: Path) -> Path:
    link = TransferModel(0.0, 3.5e9)
    profile = cpu_profile(model_shape("builtin:tiny"), TINY_STEP, 65536, {"default": link})
    return save_profile(profile, tmp_path / "tiny.json")


def test_a_plan_is_served_here_as_it_was_planned_with_each_rank_on_a_core() -> None:
    config = parse_config(local_yaml(PLAN_YAML, "float32"), "<check>")
    region = config.regions[0]
    assert (region.prefill.count, region.decode.count) == (1, 1)  # the plan's counts
    assert region.prefill.num_cpus_per_rank == region.decode.num_cpus_per_rank == 1.0
    assert config.engine_config("decode", region).dtype == "float32"
    assert config.connector == "shm" and config.router.auth_disabled
    assert config.engine_config("decode", region).scheduler.max_num_batched_tokens == 512


def test_a_plan_for_other_devices_or_regions_is_not_checked_here() -> None:
    plan = {"regions": [{"region": "east"}, {"region": "west"}]}
    tiny = cpu_profile(model_shape("builtin:tiny"), TINY_STEP, 65536, {})
    with pytest.raises(InvalidArgumentError, match="h100 devices cannot be served"):
        checkable({"regions": plan["regions"][:1]}, "h100", [tiny])
    with pytest.raises(InvalidArgumentError, match="needs a profile of this machine"):
        checkable({"regions": plan["regions"][:1]}, None, [])
    with pytest.raises(InvalidArgumentError, match="one-region plan, not 2"):
        checkable(plan, None, [tiny])
    summary = {"ttft_ms": {"p90": 1.0}, "tpot_ms": {"p90": 1.0}, "num_failed": 0}
    short = PlanCheck("east", "colocated", 1.0, 0.95, 0.95 - PROMISE_MARGIN - 0.01, summary)
    assert not short.kept and "NOT kept" in short.line()
    assert PlanCheck("east", "colocated", 1.0, 0.95, 0.95 - PROMISE_MARGIN, summary).kept


def test_the_recommended_plan_served_here_keeps_a_loose_promise(
    ray_session, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = _tiny_profile(tmp_path)
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "builtin:tiny", "--profile", str(profile), "--rate", "local=1"]
    mix = ["--prompt-len", "128", "--output-len", "16", "--num-requests", "200"]
    slo = ["--ttft-slo-ms", "5000", "--tpot-slo-ms", "1000"]  # no run on two cores misses
    limits = ["--max-devices", "2", "--spares", "0", "--prefill-tp", "1", "--decode-tp", "1"]
    check = ["--check", "--check-requests", "12", "--jobs", "1", "--out", str(out)]
    assert main([*args, *mix, *slo, *limits, *check]) == 0
    checked = json.loads(out.read_text())["check"]
    assert checked["promised"] == 1.0  # every simulated request within such SLOs
    assert checked["summary"]["num_requests"] == 12 and checked["summary"]["num_failed"] == 0
    assert checked["measured"] >= checked["promised"] - PROMISE_MARGIN and checked["kept"]
    assert "served here at 1 req/s" in capsys.readouterr().out
