"""Count flags of the benchmark commands refuse 0 before anything runs."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.flags import count
from pdserve.deploy.cli import build_parser, main

# each of these ended in a traceback at 0 (the median of no timings, the first of no
# requests, an empty page size list)
ONCE_CRASHED = [
    ("offline", "--num-requests"),
    ("transfer", "--pages"),
    ("ttft", "--requests"),
    ("peer-prefill", "--repeats"),
    ("quant", "--repeats"),
    ("multiturn", "--turns"),
    ("weights", "--instances"),
    ("coldstart", "--repeats"),
]


def _bench_commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = top.choices["bench"]
    kinds = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return dict(kinds.choices)


def test_count_takes_positive_integers_only() -> None:
    assert count("3") == 3
    for bad in ("0", "-2", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            count(bad)


@pytest.mark.parametrize(("command", "flag"), ONCE_CRASHED)
def test_a_zero_count_is_refused_naming_the_flag(capsys, command: str, flag: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", command, flag, "0"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_every_count_flag_of_every_bench_command_refuses_zero() -> None:
    checked = 0
    for sub in _bench_commands().values():
        for action in sub._actions:
            if action.type is count:
                with pytest.raises(SystemExit):
                    sub.parse_args([action.option_strings[0], "0"])
                checked += 1
    assert checked >= 80  # the commands' counts (ranks, requests, repeats, tokens ...)
