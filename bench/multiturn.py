"""Multi-turn conversations over a KV pool far smaller than their histories.

    pdserve bench multiturn --model builtin:small

Each session starts from a shared system prompt and its own context; every turn
resends the whole history (system prompt, earlier questions and answers) plus a
new question, as chat clients and agents do. Sessions take turns round-robin,
so by the time a session comes back its history has been evicted from a device
pool about ten times smaller than the working set. Three setups run the same
workload, side by side in one process:

- ``off``: no tiers (an evicted prefix is recomputed);
- ``host``: a host-memory tier that holds the whole working set;
- ``host+disk``: a host tier of a quarter of it over a disk tier that holds it all
  (round-robin sessions are the worst case for LRU: most turns come from disk).

Reported per setup: TTFT p50/p90 (from adding the request to its first token),
prompt tokens computed (not found in any cache), blocks loaded from each tier,
and requests per second. A second measurement takes one 2,000-token prefix:
computed, evicted, then asked again with a short new suffix, with tiers off
(recompute) and with the host tier (load): the TTFT of that last request.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import options_from
from pdserve.core.sampling_params import SamplingParams

BLOCK = 16


@dataclass(frozen=True)
class MultiturnOptions:
    """``pdserve bench multiturn``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model served
    sessions: int = 12  # conversations
    turns: int = 4  # turns of each
    prefix_tokens: int = 2000  # the shared prefix the reuse run reads back
    repeats: int = 3  # reuse runs (median)
    seed: int = 0  # seeds the conversations
    out: str = "bench/out/multiturn.json"  # the result file


@dataclass(frozen=True)
class Conversation:
    """The workload: ``sessions`` histories of ``turns`` turns each."""

    sessions: int = 12
    turns: int = 4
    system_tokens: int = 200
    context_tokens: int = 200
    question_tokens: int = 120
    answer_tokens: int = 40
    seed: int = 0

    @property
    def longest(self) -> int:
        per_turn = self.question_tokens + self.answer_tokens
        return self.system_tokens + self.context_tokens + self.turns * per_turn

    @property
    def working_set(self) -> int:
        """Tokens of every session's final history (the shared system prompt once)."""
        return self.system_tokens + self.sessions * (self.longest - self.system_tokens)


@dataclass
class SetupResult:
    setup: str
    ttft_p50_s: float
    ttft_p90_s: float
    prompt_tokens: int
    computed_tokens: int
    requests_per_s: float
    tier_hits: dict[str, int] = field(default_factory=dict)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_conversations(
    llm: Any, work: Conversation, vocab: int
) -> tuple[list[float], int, int, float]:
    """Play the workload; returns TTFTs, prompt tokens, tokens computed, wall seconds."""
    rng = random.Random(work.seed)
    system = _tokens(rng, work.system_tokens, vocab)
    histories = [system + _tokens(rng, work.context_tokens, vocab) for _ in range(work.sessions)]
    answer = SamplingParams(max_tokens=work.answer_tokens, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    prompt_total = computed = 0
    start = time.perf_counter()
    for _ in range(work.turns):
        for s in range(work.sessions):
            prompt = histories[s] + _tokens(rng, work.question_tokens, vocab)
            out = llm.generate([prompt], answer)[0]
            m = out.metrics
            ttfts.append(_ttft(m))
            prompt_total += len(prompt)
            computed += len(prompt) - m.num_cached_prompt_tokens
            histories[s] = prompt + list(out.outputs[0].token_ids)
    return ttfts, prompt_total, computed, time.perf_counter() - start


def _ttft(m: Any) -> float:
    assert m.first_token_time is not None
    return float(m.first_token_time - m.arrival_time)


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def _setups(work: Conversation, bytes_per_token: int, folder: str) -> dict[str, dict[str, Any]]:
    """Tier sizes: the host tier alone holds the working set; beside a disk tier, a quarter."""
    whole = 2 * work.working_set * bytes_per_token  # room for the answers' blocks too
    quarter = work.working_set // 4 * bytes_per_token
    return {
        "off": {},
        "host": {"host_tier_bytes": whole},
        "host+disk": {
            "host_tier_bytes": quarter,
            "disk_tier_bytes": whole,
            "disk_tier_path": folder,
        },
    }


def measure_setups(args: MultiturnOptions, work: Conversation) -> list[SetupResult]:
    from pdserve import LLM
    from pdserve.parallel.executor import LocalExecutor

    pool_blocks = max(-(-work.working_set // (10 * BLOCK)), -(-(work.longest + 16) // BLOCK))
    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-kv-") as folder:
        probe = LLM(args.model, num_blocks=pool_blocks)
        vocab = probe.model_config.vocab_size
        executor = probe.engine.executor
        assert isinstance(executor, LocalExecutor)
        bytes_per_token = executor.runner.bytes_per_block() // BLOCK
        probe.shutdown()
        for name, tiers in _setups(work, bytes_per_token, folder).items():
            llm = LLM(args.model, num_blocks=pool_blocks, block_size=BLOCK, **tiers)
            llm.generate([[5] * 32], SamplingParams(max_tokens=2))  # warm-up
            ttfts, prompt_total, computed, wall = run_conversations(llm, work, vocab)
            counters = llm.engine.tier_counters()
            hits = dict(counters.hits) if counters is not None else {}
            llm.check_idle()
            llm.shutdown()
            results.append(
                SetupResult(
                    name,
                    _quantile(ttfts, 0.5),
                    _quantile(ttfts, 0.9),
                    prompt_total,
                    computed,
                    len(ttfts) / wall,
                    hits,
                )
            )
            print(_row(results[-1]), flush=True)
    print(f"device pool {pool_blocks * BLOCK} tokens, working set {work.working_set} tokens")
    return results


def measure_reuse(args: MultiturnOptions, prefix_tokens: int, repeats: int) -> dict[str, float]:
    """TTFT of a request whose ``prefix_tokens`` prefix was evicted: recompute vs host load."""
    from pdserve import LLM

    pool_blocks = -(-(prefix_tokens + 64) // BLOCK) + 4
    out: dict[str, float] = {}
    setups: dict[str, dict[str, Any]] = {"recompute": {}, "host": {"host_tier_bytes": 1 << 30}}
    for name, tiers in setups.items():
        llm = LLM(args.model, num_blocks=pool_blocks, block_size=BLOCK, **tiers)
        vocab = llm.model_config.vocab_size
        rng = random.Random(1)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        times = []
        for _ in range(repeats):
            prefix = _tokens(rng, prefix_tokens, vocab)
            llm.generate([prefix + _tokens(rng, 8, vocab)], one)
            llm.generate([_tokens(rng, prefix_tokens, vocab)], one)  # evicts the prefix
            m = llm.generate([prefix + _tokens(rng, 8, vocab)], one)[0].metrics
            times.append(_ttft(m))
        llm.check_idle()
        llm.shutdown()
        out[name] = statistics.median(times)
    out["speedup"] = out["recompute"] / out["host"]
    print(
        f"{prefix_tokens}-token prefix, evicted then reused: TTFT recompute "
        f"{out['recompute'] * 1e3:.1f} ms, host tier {out['host'] * 1e3:.1f} ms "
        f"({out['speedup']:.1f}x)"
    )
    return out


def _row(r: SetupResult) -> str:
    hits = ", ".join(f"{k} {v}" for k, v in r.tier_hits.items() if v) or "-"
    return (
        f"{r.setup:10s} TTFT p50 {r.ttft_p50_s * 1e3:7.1f} ms  p90 {r.ttft_p90_s * 1e3:7.1f} ms  "
        f"computed {r.computed_tokens:6d}/{r.prompt_tokens} tokens  "
        f"{r.requests_per_s:5.2f} req/s  blocks loaded: {hits}"
    )


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(MultiturnOptions, args))


def benchmark(args: MultiturnOptions) -> int:
    """Each setup's conversations and the prefix reuse; written."""
    work = Conversation(sessions=args.sessions, turns=args.turns, seed=args.seed)
    setups = measure_setups(args, work)
    reuse = measure_reuse(args, args.prefix_tokens, args.repeats)
    write_json(
        Path(args.out),
        {
            "model": args.model,
            "workload": asdict(work),
            "setups": [asdict(r) for r in setups],
            "reuse": {"prefix_tokens": args.prefix_tokens, **reuse},
        },
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--sessions", type=count, default=12)
    p.add_argument("--turns", type=count, default=4)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--repeats", type=count, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/multiturn.json")
    p.set_defaults(func=run)
