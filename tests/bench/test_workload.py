"""Workload generation: arrival schedules, trace parsing and replay scaling, lengths, prompts."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench import workload as wl
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy.cli import main

TRACE = """TIMESTAMP, ContextTokens, GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,2000,3
2023-11-16 18:15:56.6805900,10,1
"""


def test_fixed_arrivals_are_exactly_one_over_rate_apart():
    times = wl.arrival_times("fixed", 4.0, num_requests=9)
    assert times.tolist() == [i / 4.0 for i in range(9)]
    assert wl.arrival_times("fixed", 2.0, duration_s=3.0).tolist() == [0, 0.5, 1, 1.5, 2, 2.5]


def test_poisson_arrivals_have_the_mean_rate_and_exponential_gaps():
    times = wl.arrival_times("poisson", 5.0, num_requests=20000, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0 and np.all(gaps >= 0)
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    again = wl.arrival_times("poisson", 5.0, num_requests=20000, seed=3)
    assert np.array_equal(times, again)
    within = wl.arrival_times("poisson", 5.0, duration_s=100.0, seed=1)
    assert within.max() < 100.0 and len(within) == pytest.approx(500, rel=0.15)


def test_bursts_arrive_together_at_the_mean_rate():
    times = wl.arrival_times("burst", 2.0, num_requests=12, burst_size=4)
    assert times.tolist() == [0.0] * 4 + [2.0] * 4 + [4.0] * 4
    assert wl.arrival_times("poisson", float("inf"), num_requests=3).tolist() == [0, 0, 0]


def test_bad_arrival_arguments_name_the_field():
    with pytest.raises(InvalidArgumentError, match="arrival"):
        wl.arrival_times("gamma", 1.0, num_requests=1)
    with pytest.raises(InvalidArgumentError, match="rate"):
        wl.arrival_times("fixed", 0.0, num_requests=1)
    with pytest.raises(InvalidArgumentError, match="num_requests"):
        wl.arrival_times("fixed", 1.0)
    with pytest.raises(InvalidArgumentError, match="num_requests: must be >= 1, got -3"):
        wl.arrival_times("fixed", 1.0, num_requests=-3)
    with pytest.raises(InvalidArgumentError, match="duration: must be > 0"):
        wl.arrival_times("fixed", 1.0, duration_s=float("nan"))
    trace = wl.Trace(np.arange(4.0), np.full(4, 10), np.full(4, 5))
    with pytest.raises(InvalidArgumentError, match="num_requests: must be >= 1, got 0"):
        wl.limit_trace(trace, 0, None)  # a slice [:-k] would have dropped the last k
    with pytest.raises(InvalidArgumentError, match="max_output_len: must be >= 1, got 0"):
        wl.scale_trace(trace, max_output_len=0)


def test_trace_parsing_gives_offsets_from_the_first_request(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(TRACE)
    trace = wl.read_trace(path)
    assert trace.arrival_s == pytest.approx([0.0, 4.314579, 4.31941, 10.0])
    assert trace.prompt_len.tolist() == [374, 396, 2000, 10]
    assert trace.output_len.tolist() == [44, 109, 3, 1]


def test_scaled_replay_keeps_the_trace_inter_arrival_times(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(TRACE)
    trace = wl.read_trace(path)
    fast = wl.scale_trace(trace, time_scale=0.5, length_scale=0.25, max_prompt_len=256)
    assert np.diff(fast.arrival_s) == pytest.approx(np.diff(trace.arrival_s) * 0.5)
    assert fast.prompt_len.tolist() == [94, 99, 256, 2]  # x0.25 rounded, clamped, at least 1
    assert fast.output_len.tolist() == [11, 27, 1, 1]
    at_rate = wl.scale_trace(trace, rate=0.6)  # 3 gaps over 10 s -> 0.3 req/s; doubled
    assert at_rate.arrival_s[-1] == pytest.approx(5.0)
    assert np.diff(at_rate.arrival_s) == pytest.approx(np.diff(trace.arrival_s) / 2)
    head = wl.limit_trace(trace, None, duration_s=5.0)
    assert len(head) == 3


def test_shipped_traces_load():
    conv = wl.read_trace(wl.trace_path("azure-conv"))
    code = wl.read_trace(wl.trace_path("azure-code"))
    assert (len(conv), len(code)) == (19366, 8819)
    assert np.all(np.diff(conv.arrival_s) >= 0) and conv.arrival_s[0] == 0
    with pytest.raises(InvalidArgumentError, match="shipped traces"):
        wl.trace_path("azure-nope")


def test_bad_trace_rows_name_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,x\n")
    with pytest.raises(InvalidArgumentError, match=r"bad\.csv:2"):
        wl.read_trace(path)


def test_files_that_are_not_text_are_refused_naming_the_flag(tmp_path):
    # the bytes after a good first line: the error comes while the file is read
    path = tmp_path / "blob"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\xfe\x00\n")
    with pytest.raises(InvalidArgumentError, match=r"trace: .*blob: not UTF-8 text"):
        wl.read_trace(path)
    with pytest.raises(InvalidArgumentError, match=r"prompts: .*blob: not UTF-8 text"):
        wl.read_jsonl(path, 8)
    with pytest.raises(InvalidArgumentError, match=r"prompts: no such file: .*nothing"):
        wl.read_jsonl(tmp_path / "nothing", 8)


def test_lengths_and_prompts():
    fixed = wl.sample_lengths(5, 100)
    assert fixed.tolist() == [100] * 5
    uniform = wl.sample_lengths(2000, 0, value_range=(512, 1024), seed=1)
    assert uniform.min() >= 512 and uniform.max() <= 1024
    normal = wl.sample_lengths(2000, 50, std=40, high=80, seed=2)
    assert normal.min() >= 1 and normal.max() <= 80
    for kwargs, message in (
        ({"mean": 0}, "prompt_len: must be >= 1, got 0"),
        ({"mean": 9, "std": -1.0}, "prompt_len_std: must be >= 0"),
        ({"mean": 9, "high": 0}, "max_prompt_len: must be >= 1, got 0"),
        ({"mean": 9, "value_range": (0, 4)}, "prompt_len_range: needs 1"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            wl.sample_lengths(3, name="prompt_len", **kwargs)
    rng = np.random.default_rng(0)
    ids = wl.synthetic_prompt(300, 256, rng)
    assert len(ids) == 300 and min(ids) >= 3 and max(ids) < 256
    specs = wl.build_requests(np.array([0.0, 1.0]), np.array([4, 6]), np.array([2, 3]), 256, 7)
    assert [s.prompt_len for s in specs] == [4, 6] and [s.max_tokens for s in specs] == [2, 3]
    assert specs == wl.build_requests(
        np.array([0.0, 1.0]), np.array([4, 6]), np.array([2, 3]), 256, 7
    )


def test_jsonl_prompts_are_cycled(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n')
    prompts = wl.read_jsonl(path, default_max_tokens=9)
    assert prompts == [("hello", 3), ([5, 6, 7], 9)]
    specs = wl.build_requests(np.zeros(3), None, np.zeros(3), 256, 0, prompts)
    assert specs[0].prompt_text == "hello" and specs[1].prompt_token_ids == (5, 6, 7)
    assert specs[2].prompt_text == "hello" and specs[2].max_tokens == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-concurrency", "0"], "max_concurrency: must be >= 1"),  # a semaphore of 0
        (["--request-timeout", "0"], "request_timeout: must be > 0"),
        (["--ttft-slo-ms", "0"], "ttft_slo_ms: must be > 0"),
        (["--tpot-slo-ms", "nan"], "tpot_slo_ms: must be > 0"),
        (["--warmup", "-1"], "warmup: must be >= 0"),
        (["--temperature", "-1"], "temperature: must be >= 0"),
        (["--vocab-size", "2"], "vocab_size: must be > 3"),
    ],
)
def test_bad_load_flags_are_refused_before_any_request(tmp_path, capsys, flags, message):
    # port 1: nothing listens; the flags are refused before a client is made
    argv = [
        "bench",
        "serve",
        "--target",
        "grpc://127.0.0.1:1",
        "--rate",
        "1",
        "--out",
        str(tmp_path),
        *flags,
    ]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
