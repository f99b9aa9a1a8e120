"""``pdserve bench sampler``: plain and penalised rows through the real sampler, the
penalised ones sent as the scheduler sends them (the prompt once, then a token a step)."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.sampler import _rows, measure
from pdserve.deploy.cli import main


def test_penalised_rows_carry_their_prompt_once_then_a_token_a_step() -> None:
    import random

    rng = random.Random(0)
    first, later = _rows(2, 5, 0, 50, rng), _rows(2, 5, 3, 50, rng)
    assert [(len(r.seen), r.seen_from, r.num_seen_prompt) for r in first] == [(5, 0, 5)] * 2
    assert [(len(r.seen), r.seen_from) for r in later] == [(1, 7)] * 2
    assert all(not r.penalties for r in _rows(2, 5, -1, 50, rng))
    figures = measure(3, 50, 5, 4, penalised=True)
    assert figures["step_s"] > 0 and figures["first_step_s"] > 0


def test_the_command_writes_a_row_per_vocabulary_and_batch(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = [
        "bench",
        "sampler",
        "--batch",
        "1",
        "3",
        "--vocab",
        "64",
        "--context",
        "8",
        "--steps",
        "3",
        "--repeat",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "s",
    ]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "s.json").read_text())
    assert [(r["vocab"], r["batch"]) for r in payload["rows"]] == [(64, 1), (64, 3)]
    for r in payload["rows"]:
        assert r["ratio"] == r["penalised_ms"] / r["plain_ms"] and r["first_step_ms"] > 0
    assert payload["command"].startswith("pdserve bench sampler --batch 1 3")
    assert "| 64 | 3 |" in capsys.readouterr().out
