"""The soak's pure parts on known inputs: outcomes, token checks, the request plan, RSS."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.soak import SoakOptions, add_arguments, api_key_for, check_args, log_errors
from pdserve.bench.soak_outcomes import (
    Attempt,
    RssSample,
    cancel_phase,
    check_tokens,
    classify,
    plan_attempts,
    result_table,
    rss_summary,
    tally,
    verdict,
)
from pdserve.cluster.config import parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from

REF = [10, 11, 12, 13, 14, 15, 16, 17]
MIB = 1 << 20


def attempt(**kw: object) -> Attempt:
    a = Attempt(index=0, kind="stream", prompt=0, max_tokens=8)
    for key, value in kw.items():
        setattr(a, key, value)
    return a


@pytest.mark.parametrize(
    ("fields", "outcome"),
    [
        ({"finish_reason": "length", "tokens": REF}, "completed"),
        ({"cancelled": True, "tokens": REF[:2]}, "cancelled"),
        ({"cancelled": True, "code": "CANCELLED"}, "cancelled"),
        ({"code": "UNAVAILABLE", "details": "instance failed"}, "failed"),
        ({"code": "RESOURCE_EXHAUSTED"}, "failed"),
        ({"cancelled": True, "code": "UNAVAILABLE"}, "failed"),  # the error came first
        ({"code": "INTERNAL"}, "unclear"),
        ({"code": "UNKNOWN"}, "unclear"),
        ({"code": "DEADLINE_EXCEEDED"}, "lost"),
        ({"tokens": REF[:3]}, "lost"),  # the stream ended without finish_reason
        ({}, "lost"),
    ],
)
def test_every_request_has_one_outcome(fields: dict[str, object], outcome: str) -> None:
    assert classify(attempt(**fields)) == outcome


def test_a_cancel_that_came_after_the_answer_is_a_completion() -> None:
    assert classify(attempt(cancel_at="unary", finish_reason="length", tokens=REF)) == "completed"


def test_cancel_phase_is_where_the_stream_was() -> None:
    assert cancel_phase(attempt(tokens_at_cancel=0)) == "before_first"
    assert cancel_phase(attempt(tokens_at_cancel=1, first_chunk=1)) == "after_first"
    assert cancel_phase(attempt(tokens_at_cancel=5, first_chunk=1)) == "mid_stream"
    assert cancel_phase(attempt(kind="unary", tokens_at_cancel=0)) == "unary"


@pytest.mark.parametrize(
    ("got", "complete", "expected"),
    [
        (REF, True, ("ok", -1)),
        (REF[:3], False, ("ok", -1)),  # a cancelled stream: a prefix is right
        ([], False, ("ok", -1)),
        (REF[:6], True, ("missing", 6)),  # complete but short
        ([*REF[:4], *REF[3:7]], True, ("repeated", 4)),  # token 13 sent twice
        ([*REF[:4], *REF[6:8]], False, ("missing", 4)),  # tokens 14, 15 skipped
        ([*REF, 17], True, ("repeated", 8)),  # more than max_tokens
        ([*REF[:2], 99, 98], False, ("wrong", 2)),
    ],
)
def test_tokens_are_checked_against_the_reference(
    got: list[int], complete: bool, expected: tuple[str, int]
) -> None:
    assert check_tokens(got, REF, complete) == expected


def test_tally_counts_outcomes_phases_codes_and_token_problems() -> None:
    references = [REF, [20, 21, 22, 23]]
    attempts = [
        attempt(index=0, finish_reason="length", tokens=REF),
        attempt(
            index=1,
            kind="unary",
            prompt=1,
            max_tokens=3,
            finish_reason="length",
            tokens=[20, 21, 22],
        ),
        attempt(index=2, finish_reason="length", tokens=[*REF[:4], *REF[3:7]]),
        attempt(
            index=3,
            cancelled=True,
            cancel_at="mid_stream",
            tokens=REF[:4],
            tokens_at_cancel=4,
            first_chunk=1,
        ),
        attempt(index=4, code="UNAVAILABLE", details="instance failed", tokens=REF[:2]),
        attempt(index=5, code="DEADLINE_EXCEEDED"),
        attempt(index=6, code="INTERNAL", details="internal error: IndexError"),
    ]
    t = tally(attempts, references)
    assert t["sent"] == 7
    assert t["outcomes"] == {"completed": 3, "failed": 1, "cancelled": 1, "lost": 1, "unclear": 1}
    assert t["completed_ok"] == 2
    assert t["per_kind"]["unary"]["completed"] == 1
    assert t["cancel_phases"] == {"mid_stream": 1}
    assert t["failure_codes"] == {"UNAVAILABLE: instance failed": 1}
    assert t["unclear_codes"] == {"INTERNAL: internal error: IndexError": 1}
    assert t["token_problems"] == {"repeated": 1}
    (problem,) = t["token_problem_requests"]
    assert problem["index"] == 2 and problem["at"] == 4
    assert [r["index"] for r in t["lost_or_unclear_requests"]] == [5, 6]


def test_rss_summary_compares_the_first_minutes_with_the_whole_run() -> None:
    samples = [
        RssSample(0.0, "router", 1, 100 * MIB),
        RssSample(60.0, "router", 1, 120 * MIB),
        RssSample(300.0, "router", 1, 150 * MIB),
        RssSample(10.0, "decode rank", 2, 500 * MIB),
        RssSample(200.0, "decode rank", 3, 400 * MIB),  # a replacement
        RssSample(200.0, "raylet", 4, 30 * MIB),  # seen only late
    ]
    s = rss_summary(samples, baseline_s=120.0)
    assert s["router"] == {
        "first_peak_mib": 120.0,
        "peak_mib": 150.0,
        "growth": 1.25,
        "processes": 1,
    }
    assert s["decode rank"]["growth"] == 1.0 and s["decode rank"]["processes"] == 2
    assert s["raylet"]["first_peak_mib"] == 0.0 and s["raylet"]["growth"] is None


def test_plan_alternates_kinds_and_cancels_the_asked_share() -> None:
    arrivals = np.arange(2000) * 0.01
    timing = {"ttft_p50": 0.1, "e2e_p90": 2.0}
    planned = plan_attempts(arrivals, 4, (8, 16), 0.2, timing, np.random.default_rng(0))
    kinds = [a.kind for _, a in planned]
    assert kinds[:4] == ["stream", "unary", "stream", "unary"]
    assert all(0 <= a.prompt < 4 and 8 <= a.max_tokens <= 16 for _, a in planned)
    cancels = [a for _, a in planned if a.cancel_at is not None]
    assert len(cancels) / len(planned) == pytest.approx(0.2, abs=0.03)
    assert {a.cancel_at for a in cancels if a.kind == "unary"} == {"unary"}
    assert {a.cancel_at for a in cancels if a.kind == "stream"} == {
        "before_first",
        "after_first",
        "mid_stream",
    }
    for a in cancels:
        if a.cancel_at == "mid_stream":
            assert 2 <= a.cancel_after < a.max_tokens
        elif a.cancel_at == "before_first":
            assert 0 <= a.cancel_after <= 0.1
        elif a.cancel_at == "unary":
            assert 0 <= a.cancel_after <= 2.0


def _result(**changes: object) -> dict[str, object]:
    soak = tally([attempt(finish_reason="length", tokens=REF)], [REF])
    result: dict[str, object] = {
        "capacity": {"rps": 10.0},
        "rate_rps": 8.0,
        "options": {"minutes": 2.0},
        "soak": soak,
        "kills": [{"at_s": 60.0}],
        "leaks": {"pages": 0, "not_idle": []},
        "settled": True,
        "reference": {"unstable_prompts": []},
        "after_kills": {"prompts": 1, "matching_reference": 1},
        "rss": rss_summary([RssSample(0.0, "router", 1, 100 * MIB)], 120.0),
    }
    result.update(changes)
    return result


def test_a_clean_soak_passes_and_its_table_says_so() -> None:
    result = _result()
    assert verdict(result, 1.25) == []
    table = result_table(result)
    assert "completed correctly" in table and "router" in table and "workers killed" in table


def test_the_verdict_names_leaks_lost_requests_and_memory_growth() -> None:
    soak = tally([attempt(code="DEADLINE_EXCEEDED")], [REF])
    grew = {"first_peak_mib": 100.0, "peak_mib": 200.0, "growth": 2.0, "processes": 1}
    late = {"first_peak_mib": 0.0, "peak_mib": 200.0, "growth": None, "processes": 1}
    rss = {"router": grew, "gcs_server": grew, "decode rank": late}  # Ray's: only reported
    leaks = {
        "pages": 3,
        "not_idle": ["east-decode-1: AssertionError"],
        "router_inflight": {"east": 1},
    }
    found = verdict(_result(soak=soak, rss=rss, leaks=leaks), 1.25)
    assert any("1 lost" in f for f in found)
    assert any("3 KV page(s) leaked" in f for f in found)
    assert any("in flight" in f for f in found)
    assert [f for f in found if "RSS" in f] == ["router RSS grew x2.00 after the first minutes"]
    assert "  -  (1 processes)" in result_table(_result(rss=rss))


def test_log_errors_are_collected_with_their_traceback(tmp_path: Path) -> None:
    (tmp_path / "worker-1.err").write_text(
        "12:00 INFO fine\n12:01 ERROR pdserve.router failed\nTraceback\n  IndexError\n"
    )
    (tmp_path / "worker-1.out").write_text("12:02 ERROR not a log of errors\n")
    (record,) = log_errors(str(tmp_path), context=3)
    assert record.splitlines() == [
        "worker-1.err:2",
        "12:01 ERROR pdserve.router failed",
        "Traceback",
        "  IndexError",
    ]
    assert log_errors(None) == []


def _args(*argv: str) -> SoakOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from(SoakOptions, parser.parse_args(list(argv)))


def test_the_defaults_are_valid_and_bad_flags_are_refused() -> None:
    check_args(_args())
    assert _args().minutes == 10 and _args().config == "deploy/configs/local.yaml"
    with pytest.raises(InvalidArgumentError, match="output-len"):
        check_args(_args("--output-len", "2", "8"))
    with pytest.raises(InvalidArgumentError, match="cancel-fraction"):
        check_args(_args("--cancel-fraction", "1.5"))


def test_the_client_sends_the_key_the_config_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    yaml = "model: builtin:tiny\nregions: [{name: east}]\nauth: {%s}\n"
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    assert api_key_for(parse_config(yaml % "disabled: true")) is None
    assert api_key_for(parse_config(yaml % "api_keys: [k1, k2]")) == "k1"
    monkeypatch.setenv("PDSERVE_API_KEYS", "env-key")
    assert api_key_for(parse_config(yaml % "api_keys: []")) == "env-key"
