"""Argument types the benchmark commands share."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def count(text: str) -> int:
    """An integer flag that counts something (runs, requests, tokens, ranks): at least 1.

    A count of 0 used to reach the benchmark and end in a traceback (the median of
    no timings, the first of no requests); argparse now names the flag instead.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def file_stem(text: str) -> str:
    """A ``--name``: the stem of the files a command writes inside its ``--out`` folder.

    A path (``../../x``) wrote outside that folder, and an empty name made hidden
    ``.json`` files; either is refused by name, with what is allowed.
    """
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise argparse.ArgumentTypeError(
            f"must be a file name without '/' (files go in --out), got {text!r}"
        )
    return text


def add_embedded_ray_flags(
    p: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    counts: dict[str, int],
    out: str,
) -> None:
    """The flags of a benchmark on one embedded Ray instance: ``--model``, the count
    flags ``counts`` (flag -> default) in their order, ``--num-cpus`` and ``--out``."""
    p.add_argument("--model", default="builtin:tiny")
    for flag, default in counts.items():
        p.add_argument(flag, type=count, default=default)
    p.add_argument("--num-cpus", type=count, default=4, help="the embedded Ray instance's CPUs")
    p.add_argument("--out", default=out)
    p.set_defaults(func=run)
