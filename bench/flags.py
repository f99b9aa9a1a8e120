"""Argument types the benchmark commands share."""

from __future__ import annotations

import argparse


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
