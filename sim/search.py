"""The capacity planner's count searches: the fewest count that fits, from a hint.

:func:`smallest_near` finds the fewest count in ``[lo, hi]`` for which a monotone
``fits`` holds, starting at a hint (the textbook's count) and galloping away from
it. Each ``fits`` call is a simulation, so the search can also name, before each
call, the calls it may make next (the call itself, then breadth first the next
one after each of its two outcomes, up to ``width`` of them): a caller with
several cores simulates those together (``lookahead``). The calls the search
makes, and its answer, are those of the search without a look-ahead, whatever
the width: the look-ahead only fills a cache the calls then read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def smallest_near(
    lo: int,
    hint: int,
    hi: int,
    fits: Callable[[int], bool],
    lookahead: Callable[[Sequence[int]], None] | None = None,
    width: int = 1,
) -> int | None:
    """Fewest count in [lo, hi] for which ``fits(count)`` holds (monotone), or None.

    The search starts at ``hint`` and gallops away from it, down while counts
    fit and up while they do not, doubling its stride, then bisects the last
    stride: about ``2 log2 |answer - hint|`` calls, where a bisection of the
    whole range costs ``log2 (hi - lo)`` however good the hint. With
    ``lookahead``, it is given up to ``width`` counts before each call.
    """
    known: dict[int, bool] = {}
    while True:
        done, value = _replay(lo, hint, hi, known)
        if done:
            return value
        assert value is not None
        if lookahead is not None and width > 1:
            lookahead(_next_calls(lo, hint, hi, known, width))
        known[value] = fits(value)


class _Unknown(Exception):
    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


def _replay(lo: int, hint: int, hi: int, known: dict[int, bool]) -> tuple[bool, int | None]:
    """(True, the answer) if ``known`` settles the search; else (False, its next call)."""

    def fits(n: int) -> bool:
        if n not in known:
            raise _Unknown(n)
        return known[n]

    try:
        return True, _gallop(lo, hint, hi, fits)
    except _Unknown as e:
        return False, e.count


def _next_calls(lo: int, hint: int, hi: int, known: dict[int, bool], width: int) -> list[int]:
    """The next call, then breadth first the calls after each outcome: ``width`` at most."""
    out: list[int] = []
    frontier = [known]
    while frontier and len(out) < width:
        k = frontier.pop(0)
        done, count = _replay(lo, hint, hi, k)
        if done or count is None:
            continue
        if count not in out:
            out.append(count)
        frontier += [{**k, count: True}, {**k, count: False}]
    return out


def _gallop(lo: int, hint: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    lo = min(lo, hi)
    x = min(max(hint, lo), hi)
    stride = 1
    if fits(x):
        good = x  # the largest count known to fit; search below it
        while good > lo:
            x = max(lo, good - stride)
            if not fits(x):
                return _bisect(x, good, fits)
            good, stride = x, stride * 2
        return good
    bad = x  # the smallest count known to miss; search above it
    while bad < hi:
        x = min(hi, bad + stride)
        if fits(x):
            return _bisect(bad, x, fits)
        bad, stride = x, stride * 2
    return None


def _bisect(bad: int, good: int, fits: Callable[[int], bool]) -> int:
    """Fewest count in (bad, good] that fits, given that ``bad`` misses and ``good`` fits."""
    while good - bad > 1:
        mid = (bad + good) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
