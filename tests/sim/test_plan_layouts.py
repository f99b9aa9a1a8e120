"""Colocated or disaggregated: the planner plans both layouts and recommends the cheaper."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.cluster.config import parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cli import main
from pdserve.sim.analytic import DEVICES, model_shape
from pdserve.sim.build import ProfileBook
from pdserve.sim.candidates import Candidates, LayoutCase
from pdserve.sim.flags import Assumptions
from pdserve.sim.plan import LAYOUTS, LengthMix, PlanLimits, PlanSlo, cluster_yaml, plan_region
from pdserve.sim.plan_choice import choose_regions, layouts_from

BW = DEVICES["h100"].mem_bw


def _argv(line: str, *values: object) -> list[str]:
    """The words of ``line``, each ``{}`` in it the next of ``values``."""
    given = iter(values)
    return [str(next(given)) if word == "{}" else word for word in line.split()]


def _book() -> ProfileBook:
    return ProfileBook(model_shape("llama-7b"), [], "h100", Assumptions())


def _mix(prompt: int, output: int) -> LengthMix:
    return LengthMix(np.full(64, prompt), np.full(64, output))


def test_a_colocated_plan_meets_the_slos_and_its_yaml_serves_with_no_prefill() -> None:
    slo, limits = PlanSlo(ttft_s=0.5, tpot_s=0.04), PlanLimits(max_devices=40, num_requests=600)
    plan = plan_region(_book(), "east", 20.0, _mix(1000, 64), limits, slo, BW, layout="colocated")
    assert plan.layout == "colocated" and plan.prefill == 0 and plan.decode >= 2  # N+1
    assert plan.devices == plan.decode * plan.decode_tp
    o = plan.at_forecast
    assert o.prefill == 0 and o.ttft_s <= slo.ttft_s and o.tpot_s <= slo.tpot_s and o.failed == 0
    assert 0.9 <= o.attainment <= 1.0 and o.goodput_rps > 0
    text = cluster_yaml("llama-7b", "east", 0, plan.decode, 1, 1, limits, slo)
    region = parse_config(text, "<plan>").regions[0]
    assert (region.prefill.count, region.prefill.min, region.decode.count) == (0, 0, plan.decode)
    # fewer instances miss an SLO (the search's answer is the fewest)
    case = LayoutCase(_book(), "east", _mix(1000, 64), (1, 1), limits, slo)
    fewer = Candidates(case, 20.0 * 1.3, 600).run(0, plan.decode - limits.spares - 1)
    assert not all(fewer.meets(slo))


def test_short_prompts_at_a_loose_slo_colocate_for_no_more_devices() -> None:
    slo, limits = PlanSlo(ttft_s=2.0, tpot_s=0.1), PlanLimits(max_devices=40, num_requests=600)
    (c,) = choose_regions(_book(), {"east": 20.0}, _mix(200, 64), limits, slo, BW)
    dis, col = c.plans["disaggregated"], c.plans["colocated"]
    assert not isinstance(dis, Exception) and not isinstance(col, Exception)
    assert c.chosen is col and col.devices <= dis.devices
    assert c.why and c.why[0].startswith("disaggregated")


def test_long_prompts_and_outputs_at_a_tight_ttft_disaggregate() -> None:
    # 3,000-token prompts prefilled beside 512-token decodes: every colocated decode
    # waits out its neighbours' prompts, and its TTFT the decodes
    slo, limits = PlanSlo(ttft_s=0.18, tpot_s=0.02), PlanLimits(max_devices=40, num_requests=700)
    (c,) = choose_regions(_book(), {"east": 8.0}, _mix(3000, 512), limits, slo, BW)
    dis, col = c.plans["disaggregated"], c.plans["colocated"]
    assert c.chosen is dis and c.chosen.layout == "disaggregated"
    assert isinstance(col, Exception) or col.devices > dis.devices
    assert c.why[0].startswith("colocated")


def test_a_layout_the_devices_cannot_hold_is_reported_and_the_other_recommended() -> None:
    # two devices hold no prefill, decode and spare each; a colocated instance and its spare fit
    slo, limits = PlanSlo(ttft_s=1.0, tpot_s=0.05), PlanLimits(max_devices=2, num_requests=400)
    (c,) = choose_regions(_book(), {"east": 2.0}, _mix(500, 32), limits, slo, BW)
    assert c.chosen.layout == "colocated" and c.chosen.devices == 2
    assert isinstance(c.plans["disaggregated"], InvalidArgumentError)
    assert c.why[0].startswith("disaggregated is infeasible: region east at 2 req/s: tp=1/1:")
    assert "2 devices cannot hold one prefill and one decode instance" in c.why[0]


def test_layout_flag_values() -> None:
    assert layouts_from("both") == LAYOUTS == ("disaggregated", "colocated")
    assert layouts_from("colocated") == ("colocated",)
    assert layouts_from("disaggregated") == ("disaggregated",)
    with pytest.raises(InvalidArgumentError, match="colocated, disaggregated or both"):
        layouts_from("mixed")
    with pytest.raises(SystemExit) as exit_:
        main(_argv("plan --model llama-7b --device h100 --rate east=4 --layout mixed"))
    assert exit_.value.code == 2


PLAN = (
    "plan --model llama-7b --device h100 --rate east=4 --prompt-len 1000 --output-len 32 "
    "--num-requests 100 --ttft-slo-ms 500 --tpot-slo-ms 40 --jobs 1 --out {}"
)


def test_plan_prints_both_layouts_and_writes_the_recommended_yaml(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.json"
    assert main(_argv(PLAN, out)) == 0
    text = capsys.readouterr().out
    assert "layouts compared" in text and "goodput/device" in text and "SLO attainment" in text
    assert "recommended: " in text
    region = json.loads(out.read_text())["regions"][0]
    assert set(region["compared"]) == {"disaggregated", "colocated"}
    chosen = region["layout"]
    assert region["compared"][chosen]["devices"] == region["devices"]
    config = parse_config(region["cluster_yaml"], "<plan>").regions[0]
    assert config.prefill.count == region["prefill"] and config.decode.count == region["decode"]
    assert (chosen == "colocated") == (config.prefill.count == 0)


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_plan_of_one_layout_compares_nothing(tmp_path, capsys, layout) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.json"
    assert main([*_argv(PLAN, out), "--layout", layout]) == 0
    assert "layouts compared" not in capsys.readouterr().out
    region = json.loads(out.read_text())["regions"][0]
    assert region["layout"] == layout and list(region["compared"]) == [layout]
    assert (region["prefill"] == 0) == (layout == "colocated")


def test_plan_fails_only_when_both_layouts_are_infeasible(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(
        _argv(
            "plan --model llama-7b --device h100 --rate east=5 --prompt-len 1000 "
            "--ttft-slo-ms 20 --tpot-slo-ms 50 --jobs 1"
        )
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "no layout meets the SLOs: disaggregated: " in err and "; colocated: " in err
    assert "colocated tp=1: TTFT SLO 20 ms cannot be met" in err


def test_the_sweep_prints_a_row_per_slo_pair_with_both_layouts(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from pdserve.sim.plan_sweep import main as sweep_main

    out = tmp_path / "sweep.json"
    argv = "--trace azure-code --rate 5 --ttft-ms 1000 --tpot-ms 100 --jobs 1 --out {}"
    assert sweep_main(_argv(argv, out)) == 0
    (row,) = json.loads(out.read_text())
    assert row["recommended"] in LAYOUTS and row["colocated"]["prefill"] == 0
    assert row["disaggregated"]["devices"] >= 4 and 0 < row["colocated"]["attainment"] <= 1
    assert "| azure-code | 1000 | 100 |" in capsys.readouterr().out
