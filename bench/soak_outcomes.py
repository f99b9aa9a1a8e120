"""What a soak request saw, and what it means: pure functions, no cluster.

Every request ends as exactly one outcome (:func:`classify`); the tokens it
received are checked against its prompt's greedy reference
(:func:`check_tokens`); :func:`tally` counts a run, :func:`rss_summary` sums up
the memory samples, :func:`verdict` says whether the run passed and
:func:`result_table` prints it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

UNCLEAR_CODES = ("UNKNOWN", "INTERNAL")  # a failure that does not say what went wrong
CANCEL_PHASES = ("before_first", "after_first", "mid_stream")
OUTCOMES = ("completed", "failed", "cancelled", "lost", "unclear")
MIB = 1 << 20
VOCAB = 256  # prompt token ids are drawn from [3, VOCAB)
# Processes whose memory growth fails the soak; Ray's own (GCS, raylet, agents) are reported.
PDSERVE_PROCESSES = ("driver", "controller", "router", "prefill rank", "decode rank")


@dataclass
class Attempt:
    """One request as the client saw it.

    ``cancel_at`` is the phase the client planned to cancel at (None: never);
    ``cancelled`` is set only when the cancel reached the call before its answer, and
    ``tokens_at_cancel`` is how many tokens had arrived then.
    """

    index: int
    kind: str  # "stream" (Generate) or "unary" (Complete)
    prompt: int  # index into the prompt pool
    max_tokens: int
    sent_s: float = 0.0
    cancel_at: str | None = None
    cancel_after: float = 0.0  # seconds (before_first, unary) or tokens (mid_stream)
    cancelled: bool = False
    tokens_at_cancel: int = 0
    first_chunk: int = 0  # tokens in the first chunk of a stream
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    code: str | None = None  # gRPC status name of the error that ended it
    details: str = ""
    e2e_s: float | None = None
    ttft_s: float | None = None


def classify(a: Attempt) -> str:
    """``completed``: a final answer; ``cancelled``: the client cancelled first;
    ``failed``: a gRPC status that says what happened; ``unclear``: UNKNOWN or INTERNAL;
    ``lost``: no final answer by the deadline, or a stream that ended without one."""
    if a.code is None and a.finish_reason:
        return "completed"
    if a.cancelled and a.code in (None, "CANCELLED"):
        return "cancelled"
    if a.code is None or a.code == "DEADLINE_EXCEEDED":
        return "lost"
    return "unclear" if a.code in UNCLEAR_CODES else "failed"


def cancel_phase(a: Attempt) -> str:
    """Where a cancelled request was when the cancel went out (unary calls cannot tell)."""
    if a.kind == "unary":
        return "unary"
    if a.tokens_at_cancel == 0:
        return "before_first"
    return "after_first" if a.tokens_at_cancel <= a.first_chunk else "mid_stream"


def check_tokens(got: Sequence[int], want: Sequence[int], complete: bool) -> tuple[str, int]:
    """("ok" | "missing" | "repeated" | "wrong", index of the first bad token or -1).

    ``want`` is the reference for the request's ``max_tokens``. A complete answer must
    equal it; a partial one (cancelled, failed) must be a prefix of it. At the first
    difference the rest of ``got`` is aligned with ``want``: resuming at an earlier
    reference position is a repeat, at a later one a gap.
    """
    n = min(len(got), len(want))
    i = next((k for k in range(n) if got[k] != want[k]), n)
    if i == len(got) == len(want) or (i == len(got) and not complete):
        return "ok", -1
    if i == len(got):
        return "missing", i
    if i == len(want):
        return "repeated", i  # more tokens than asked for
    best_j, best_m = -1, 0
    for j in range(len(want)):
        m = 0
        while i + m < len(got) and j + m < len(want) and got[i + m] == want[j + m]:
            m += 1
        if m > best_m or (m == best_m and m > 0 and abs(j - i) < abs(best_j - i)):
            best_j, best_m = j, m
    if best_m == 0:
        return "wrong", i
    return ("repeated" if best_j < i else "missing"), i


@dataclass(frozen=True)
class RssSample:
    t_s: float  # seconds since sampling began
    kind: str  # "driver", "router", "prefill rank", "raylet", ...
    pid: int
    rss: int  # bytes


def rss_summary(samples: Sequence[RssSample], baseline_s: float) -> dict[str, dict[str, Any]]:
    """Per process kind: peak RSS (MiB) of one process in the first ``baseline_s`` and over
    the run, their ratio, and how many processes of that kind were seen."""
    by_kind: dict[str, list[RssSample]] = defaultdict(list)
    out: dict[str, dict[str, Any]] = {}
    for s in samples:
        by_kind[s.kind].append(s)
    for kind, rows in sorted(by_kind.items()):
        early = [s.rss for s in rows if s.t_s <= baseline_s]
        first = max(early) / MIB if early else 0.0
        peak = max(s.rss for s in rows) / MIB
        out[kind] = {
            "first_peak_mib": round(first, 1),
            "peak_mib": round(peak, 1),
            "growth": round(peak / first, 3) if first else None,  # None: first seen later
            "processes": len({s.pid for s in rows}),
        }
    return out


def tally(attempts: Sequence[Attempt], references: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Outcome counts (all, per kind, per cancel phase), failure codes and token problems."""
    outcomes: Counter[str] = Counter()
    per_kind: dict[str, Counter[str]] = defaultdict(Counter)
    phases: Counter[str] = Counter()
    codes: dict[str, Counter[str]] = {"failed": Counter(), "unclear": Counter()}
    problems, unfinished = [], []
    for a in attempts:
        outcome = classify(a)
        outcomes[outcome] += 1
        per_kind[a.kind][outcome] += 1
        if outcome == "cancelled":
            phases[cancel_phase(a)] += 1
        if outcome in codes:
            codes[outcome][f"{a.code}: {a.details[:120]}"] += 1
        if outcome in ("lost", "unclear"):
            unfinished.append(_brief(a, outcome))
        want = references[a.prompt][: a.max_tokens]
        check, at = check_tokens(a.tokens, want, outcome == "completed")
        if check != "ok":
            problems.append(
                {
                    **_brief(a, outcome),
                    "check": check,
                    "at": at,
                    "got": a.tokens[max(0, at - 3) : at + 5],
                    "want": list(want[max(0, at - 3) : at + 5]),
                }
            )
    return {
        "sent": len(attempts),
        "completed_ok": outcomes["completed"] - sum(p["outcome"] == "completed" for p in problems),
        "outcomes": {k: outcomes[k] for k in OUTCOMES},
        "per_kind": {k: {o: c[o] for o in OUTCOMES} for k, c in sorted(per_kind.items())},
        "cancel_phases": dict(phases),
        "failure_codes": dict(codes["failed"].most_common(10)),
        "unclear_codes": dict(codes["unclear"].most_common(10)),
        "token_problems": Counter(p["check"] for p in problems),
        "token_problem_requests": problems[:50],  # the first ones, in full
        "lost_or_unclear_requests": unfinished[:50],
    }


def _brief(a: Attempt, outcome: str) -> dict[str, Any]:
    return {
        "index": a.index,
        "kind": a.kind,
        "outcome": outcome,
        "sent_s": round(a.sent_s, 2),
        "tokens": len(a.tokens),
        "max_tokens": a.max_tokens,
        "cancel_at": a.cancel_at,
        "code": a.code,
        "details": a.details[:200],
    }


def result_table(result: dict[str, Any]) -> str:
    """The soak's figures as a plain-text table (the JSON holds the details)."""
    t, o = result["soak"], result["soak"]["outcomes"]
    rows = [
        ("requests sent", t["sent"], ""),
        ("completed correctly", t["completed_ok"], ""),
        ("failed with a clear status", o["failed"], ", ".join(t["failure_codes"]) or "-"),
        (
            "cancelled by the client",
            o["cancelled"],
            ", ".join(f"{k} {v}" for k, v in sorted(t["cancel_phases"].items())) or "-",
        ),
        ("lost (must be 0)", o["lost"], ""),
        ("failed UNKNOWN/INTERNAL (must be 0)", o["unclear"], ", ".join(t["unclear_codes"])),
        ("repeated tokens (must be 0)", t["token_problems"].get("repeated", 0), ""),
        ("missing tokens (must be 0)", t["token_problems"].get("missing", 0), ""),
        ("wrong tokens", t["token_problems"].get("wrong", 0), ""),
        ("workers killed", len(result["kills"]), ""),
        (
            "KV pages leaked at the end (must be 0)",
            result["leaks"]["pages"],
            "; ".join(result["leaks"]["not_idle"]) or "idle checks pass",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"capacity {result['capacity']['rps']:.2f} req/s, load {result['rate_rps']:.2f} req/s "
        f"for {result['options']['minutes']:g} min"
    ]
    lines += [f"{name:<{width}}  {value:>7}  {note}".rstrip() for name, value, note in rows]
    first = f"first {result['options'].get('rss_baseline_minutes', 2):g} min"
    lines += ["", f"{'peak RSS (MiB)':<22} {first:>11} {'whole run':>10} {'growth':>7}"]
    for kind, r in result["rss"].items():
        note = "" if kind in PDSERVE_PROCESSES else ", Ray's own"
        growth = "-" if r["growth"] is None else f"{r['growth']:.2f}"
        lines.append(
            f"{kind:<22} {r['first_peak_mib']:>11.1f} {r['peak_mib']:>10.1f} "
            f"{growth:>7}  ({r['processes']} processes{note})"
        )
    return "\n".join(lines)


def plan_attempts(
    arrivals: np.ndarray,
    pool_size: int,
    output_len: tuple[int, int],
    cancel_fraction: float,
    timing: dict[str, float],
    rng: np.random.Generator,
) -> list[tuple[float, Attempt]]:
    """(send offset, request) for each arrival: every other one unary, a random prompt and
    length, and ``cancel_fraction`` of them cancelled at a random phase. ``timing``
    (seconds, from the capacity phase): ``ttft_p50`` bounds the delay of a cancel before
    the first token, ``e2e_p90`` that of a unary cancel."""
    out = []
    for i, at in enumerate(arrivals):
        kind = "stream" if i % 2 == 0 else "unary"
        max_tokens = int(rng.integers(output_len[0], output_len[1] + 1))
        a = Attempt(i, kind, int(rng.integers(pool_size)), max_tokens)
        if rng.random() < cancel_fraction:
            a.cancel_at = "unary" if kind == "unary" else str(rng.choice(CANCEL_PHASES))
            if a.cancel_at == "mid_stream":
                a.cancel_after = float(rng.integers(2, a.max_tokens))
            elif a.cancel_at != "after_first":
                bound = timing["ttft_p50"] if a.cancel_at == "before_first" else timing["e2e_p90"]
                a.cancel_after = float(rng.uniform(0.0, bound))
        out.append((float(at), a))
    return out


def request_json(a: Attempt) -> dict[str, Any]:
    row = dataclasses.asdict(a)
    row["tokens"] = len(a.tokens)  # the tokens themselves: in token_problem_requests
    row["outcome"] = classify(a)
    return row


def verdict(result: dict[str, Any], growth_limit: float) -> list[str]:
    """What the soak found wrong (empty: it passed)."""
    t = result["soak"]
    found = [f"{t['outcomes'][k]} {k} request(s)" for k in ("lost", "unclear") if t["outcomes"][k]]
    found += [f"{n} request(s) with {k} tokens" for k, n in t["token_problems"].items()]
    found += [
        f"{n} request(s) with {k} tokens while measuring capacity"
        for k, n in result["capacity"].get("token_problems", {}).items()
    ]
    leaks = result["leaks"]
    if leaks["pages"] or leaks["not_idle"]:
        found.append(f"{leaks['pages']} KV page(s) leaked; {leaks['not_idle']}")
    if any(leaks.get("router_inflight", {}).values()):
        found.append(f"the router still counts requests in flight: {leaks['router_inflight']}")
    if not result["settled"]:
        found.append("the cluster was not whole and idle at the end")
    if result["reference"]["unstable_prompts"]:
        found.append(f"greedy output differs run to run: {result['reference']['unstable_prompts']}")
    a = result["after_kills"]
    if a["matching_reference"] != a["prompts"]:
        found.append(f"after the kills {a['matching_reference']}/{a['prompts']} prompts match")
    found += [
        f"{kind} RSS grew x{r['growth']:.2f} after the first minutes"
        for kind, r in result["rss"].items()
        if kind in PDSERVE_PROCESSES and (r["growth"] or 0.0) > growth_limit
    ]
    return found
