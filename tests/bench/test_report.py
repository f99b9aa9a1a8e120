"""Serving-benchmark arithmetic on known inputs: per-request latencies, percentiles,
attainment, goodput and the best rate of a sweep."""

from __future__ import annotations

import pytest

from pdserve.bench.report import (
    RequestRecord,
    Slo,
    attainment,
    goodput,
    inter_token_latencies,
    make_record,
    max_rate_meeting,
    measurement_window,
    percentiles,
    spread_counts,
    summarize,
)


def record(index: int, sent: float, ttft: float, tpot: float | None, e2e: float, ok: bool = True):
    return RequestRecord(
        index,
        sent,
        sent,
        10,
        5,
        ok=ok,
        error=None if ok else "UNAVAILABLE: gone",
        output_len=5 if ok else 0,
        ttft_s=ttft if ok else None,
        tpot_s=tpot if ok else None,
        e2e_s=e2e,
    )


def test_record_from_chunks_one_token_each():
    r = make_record(0, 0.0, 0.1, 8, 4, [0.5, 0.6, 0.8, 0.9], [1, 1, 1, 1], e2e_s=1.1)
    assert r.ok and r.output_len == 4
    assert r.ttft_s == 0.5
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.1])
    assert not r.tokens_per_chunk_estimated


def test_chunk_of_several_tokens_splits_its_gap():
    # first chunk 2 tokens at 1.0 (the second came with the first: no wait); then 3
    # tokens after a 0.3 s gap; an empty final chunk
    itl = inter_token_latencies([1.0, 1.3, 1.4], [2, 3, 0])
    assert itl == pytest.approx([0.0, 0.1, 0.1, 0.1])
    r = make_record(0, 0.0, 0.0, 8, 5, [1.0, 1.3, 1.4], [2, 3, 0], e2e_s=1.4)
    assert r.output_len == 5 and r.ttft_s == 1.0
    assert len(r.itl_s) == r.output_len - 1 and sum(r.itl_s) == pytest.approx(0.3)
    assert r.tpot_s == pytest.approx(0.4 / 4)


def test_first_chunk_without_tokens_is_not_the_first_token():
    r = make_record(0, 0.0, 0.0, 8, 2, [0.2, 0.5, 0.7], [0, 1, 1], e2e_s=0.7)
    assert r.ttft_s == 0.5 and r.itl_s == pytest.approx([0.2])


def test_unknown_chunk_counts_share_the_reported_total():
    assert spread_counts(7, 3) == [2, 3, 2] and sum(spread_counts(7, 3)) == 7
    r = make_record(0, 0.0, 0.0, 8, 8, [0.5, 0.7, 0.9], [None, None, None], 1.0, 7)
    assert r.tokens_per_chunk_estimated
    assert r.output_len == 7  # 1 + 3 + 3
    assert r.itl_s == pytest.approx([0.2 / 3] * 3 + [0.2 / 3] * 3)


def test_single_token_has_no_tpot_and_a_tokenless_stream_fails():
    one = make_record(0, 0.0, 0.0, 8, 1, [0.3], [1], 0.31)
    assert one.ok and one.tpot_s is None and one.itl_s == []
    none = make_record(0, 0.0, 0.0, 8, 1, [], [], 0.31)
    assert not none.ok and none.error


def test_percentiles_interpolate_between_ranks():
    values = list(range(1, 101))  # 1..100
    p = percentiles(values)
    assert p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {}
    assert percentiles([3.0])["p99"] == 3.0


def test_attainment_and_goodput_count_both_slos_and_failures():
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0, 0.0, 0.5, 0.05, 2.0),  # meets both
        record(1, 1.0, 1.5, 0.05, 3.0),  # TTFT too slow
        record(2, 2.0, 0.5, 0.20, 4.0),  # TPOT too slow
        record(3, 3.0, 0.2, None, 2.5),  # one token: no TPOT, meets
        record(4, 4.0, 0.0, None, 1.0, ok=False),  # failed
    ]
    assert measurement_window(records) == pytest.approx(6.0)  # sends 0..4, last end 2+4=6
    assert attainment(records, slo) == pytest.approx(2 / 5)
    assert goodput(records, slo) == pytest.approx(2 / 6.0)
    assert attainment(records, Slo()) == pytest.approx(4 / 5)  # no objectives: every success
    s = summarize(records, slo)
    assert (s["num_ok"], s["num_failed"]) == (4, 1)
    assert s["errors"] == {"UNAVAILABLE: gone": 1}
    assert s["throughput_rps"] == pytest.approx(4 / 6.0)
    assert s["output_tok_s"] == pytest.approx(20 / 6.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert s["goodput_rps"] == pytest.approx(2 / 6.0)
    assert s["offered_rate_rps"] == pytest.approx(4 / 4.0)


def test_max_rate_meeting_stops_at_the_first_rate_below_target():
    rates = [0.5, 1.0, 2.0, 1.5, 3.0]
    att = [1.0, 0.95, 0.92, 0.8, 0.97]  # 1.5 misses; 2 and 3 do not count after it
    assert max_rate_meeting(rates, [1.0, 0.95, 0.8, 0.92, 0.97]) == 1.5
    assert max_rate_meeting(rates, att) == 1.0
    assert max_rate_meeting([1.0], [0.5]) is None


def test_result_json_parses_to_the_payload_with_one_line_per_record(tmp_path):
    """The result file is the payload (records as ``asdict`` gives them), indented for
    the summary and one line per request record."""
    import json
    from dataclasses import asdict

    from pdserve.bench.compact_json import dumps
    from pdserve.bench.report import records_json, write_json

    records = [record(i, 0.1 * i, 0.05, 0.01, 0.2) for i in range(3)]
    records[1].itl_s = [0.01, 0.012, float("inf")]
    payload = {
        "summary": {"ttft_ms": {"p50": 50.0, "p90": None}, "errors": {}},
        "runs": [{"rate": 2.0, "requests": records_json(records)}],
        "counts": [{"t_s": 0.0, "prefill": 1}, {"t_s": 1.5, "prefill": 2}],
        "labels": ("a", "b"),
        3: True,
        "nested": [[1, 2], [{"x": {"y": 1}}]],
    }
    text = write_json(tmp_path / "r.json", payload).read_text()
    assert json.loads(text) == json.loads(json.dumps(payload))
    assert json.loads(text)["runs"][0]["requests"] == [asdict(r) for r in records]
    lines = text.splitlines()
    assert sum('"itl_s"' in line for line in lines) == 3  # a record a line
    assert any(line.strip() == '"p50": 50.0,' for line in lines)  # summaries indented
    assert dumps([]) == "[]" and dumps({}) == "{}"
    with pytest.raises(TypeError, match="set"):
        dumps({"bad": [{1, 2}]})
