"""The simulated workload: the same arrivals and lengths ``pdserve bench serve`` sends.

:func:`workload_from_args` reads the workload flags of ``pdserve bench serve``
(:func:`pdserve.bench.serve.add_workload_flags`) and builds the arrival
offsets and lengths with the same functions and seeds
(:mod:`pdserve.bench.workload`), so a simulated run and a measured run of one
command line see the same requests (warm-up requests are not simulated). Each
request also gets a home region, drawn by ``shares`` (default: even).

Prompts are token ids only where they matter, for the prefix cache: a
``--prompts`` file's ids are used as given; a synthetic prompt is a unique
first block (the request's index in base ``vocab``) then filler, so no two
synthetic prompts share a cached block, as with random ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.bench import workload as wl
from pdserve.core.errors import InvalidArgumentError


@dataclass(frozen=True)
class SimWorkload:
    arrival_s: np.ndarray  # [N] float64, non-decreasing
    prompt_len: np.ndarray  # [N] int64
    output_len: np.ndarray  # [N] int64
    home: np.ndarray  # [N] int16: index of the home region
    prompts: tuple[tuple[int, ...], ...] | None = None  # cycled, when given
    vocab_size: int = 256

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("prompt_len", "output_len", "home"):
            if len(getattr(self, name)) != n:
                raise InvalidArgumentError(name, f"has {len(getattr(self, name))} entries, not {n}")
        if n and (np.diff(self.arrival_s) < 0).any():
            raise InvalidArgumentError("arrival_s", "must be non-decreasing")
        if n and ((self.prompt_len < 1).any() or (self.output_len < 1).any()):
            raise InvalidArgumentError("prompt_len", "prompt and output lengths must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def prompt(self, i: int) -> list[int]:
        if self.prompts is not None:
            return list(self.prompts[i % len(self.prompts)])
        n, base = int(self.prompt_len[i]), self.vocab_size - wl.FIRST_TOKEN_ID
        head, x = [], i
        for _ in range(min(n, 4)):  # 4 digits: unique for base**4 requests
            head.append(wl.FIRST_TOKEN_ID + x % base)
            x //= base
        return head + [wl.FIRST_TOKEN_ID] * (n - len(head))


def assign_homes(n: int, shares: list[float], seed: int) -> np.ndarray:
    """Home region index per request, drawn with probabilities ``shares``."""
    p = np.asarray(shares, dtype=np.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise InvalidArgumentError("region_share", "shares must be >= 0 and not all 0")
    if len(p) == 1:
        return np.zeros(n, dtype=np.int16)
    return np.random.default_rng(seed).choice(len(p), size=n, p=p / p.sum()).astype(np.int16)


def workload_from_args(
    args: wl.WorkloadFlags, rate: float | None, shares: list[float]
) -> SimWorkload:
    """The measured requests ``pdserve bench serve`` would send with these flags at ``rate``."""
    prompts: tuple[tuple[int, ...], ...] | None = None
    if args.prompts:
        items = wl.read_jsonl(args.prompts, args.output_len)
        if any(isinstance(p, str) for p, _ in items):
            raise InvalidArgumentError(
                "prompts", "the simulator needs token ids, not text, in --prompts"
            )
        prompts = tuple(tuple(int(t) for t in p) for p, _ in items)
    schedule = wl.flag_schedule(args, rate)
    arrival, prompt_len, output_len = schedule.arrival_s, schedule.prompt_len, schedule.output_len
    if prompts is not None:  # cycled over the arrivals, as the load generator does
        picks = [items[i % len(items)] for i in range(len(arrival))]
        prompt_len = np.array([len(p) for p, _ in picks], dtype=np.int64)
        output_len = np.array([m for _, m in picks], dtype=np.int64)
    homes = assign_homes(len(arrival), shares, args.seed)
    return SimWorkload(
        np.asarray(arrival, np.float64),
        np.asarray(prompt_len, np.int64),
        np.asarray(output_len, np.int64),
        homes,
        prompts,
        args.vocab_size,
    )
