"""``pdserve bench peer-prefill``: a prompt's prefix from a peer's cache against recomputing it.

One prefill and one decode instance (real Ray actors, the chosen connector).
For each repeat, two fresh prompts of ``--prompt-tokens``:

- recompute: the decode instance prefills the whole prompt itself (the cost
  of a request whose prefix is cached only on an instance that cannot take it);
- peer: the prefill instance first holds the prompt's pages (it prefilled it
  for nobody), then the decode instance is asked to reserve the prompt with
  that instance named as the peer: the pages move over the connector and only
  the last partial page is computed.

Both are timed from the reservation to the first token (``max_tokens=1``), on
the decode instance, so the same engine computes in both; the ratio is the
figure. ``transfer`` in the JSON is the connector's own bytes and seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from pdserve import LLM
from pdserve.backends import DisaggregatedBackend
from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.config import DisaggregationConfig
from pdserve.core.messages import PeerPrefix, PrefillRequest, ReserveRequest
from pdserve.core.options import options_from
from pdserve.core.sampling_params import SamplingParams

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class PeerPrefillOptions:
    """``pdserve bench peer-prefill``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model of both instances
    connector: str = "shm"  # the KV connector between them
    prompt_tokens: int = 2000  # tokens of each prompt
    repeats: int = 5  # prompts timed each way
    seed: int = 0  # seeds the prompts
    out: str = "bench/out/peer_prefill.json"  # the result file


def _first_token_s(decode: Any, request: ReserveRequest) -> float:
    start = time.perf_counter()
    reservation = ray.get(decode.reserve.remote(request, None, None))
    assert reservation.local, "the decode instance should prefill this prompt itself"
    ray.get(decode.wait.remote([request.request_id]))
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(PeerPrefillOptions, args))


def benchmark(args: PeerPrefillOptions) -> int:
    """Prefixes recomputed against read from a peer, in turn; written."""
    llm = LLM(
        args.model,
        disaggregated=True,
        connector=args.connector,
        num_cpus_per_rank=1,
        disaggregation=DisaggregationConfig(local_prefill_cached_fraction=0.5),
    )
    try:
        b = llm.backend
        assert isinstance(b, DisaggregatedBackend)
        prefill, decode = b.prefill.leader, b.decode.leader
        vocab = llm.model_config.vocab_size
        rng = random.Random(args.seed)
        blocks = (args.prompt_tokens - 1) // llm.config.cache.block_size
        recompute, peer = [], []
        for i in range(args.repeats):
            cold = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            recompute.append(
                _first_token_s(decode, ReserveRequest(f"cold{i}", cold, FIRST, prefill_here=True))
            )
            warm = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            ray.get(prefill.prefill.remote(PrefillRequest(f"warm{i}", warm, FIRST, None)))
            hint = PeerPrefix(b.prefill.instance_id, blocks)
            peer.append(_first_token_s(decode, ReserveRequest(f"peer{i}", warm, FIRST, peer=hint)))
        sent = ray.get(prefill.stats.remote()).sent
        llm.check_idle()
    finally:
        llm.shutdown()
    result = {
        "model": args.model,
        "connector": args.connector,
        "prompt_tokens": args.prompt_tokens,
        "recompute_s": recompute,
        "peer_s": peer,
        "recompute_median_s": statistics.median(recompute),
        "peer_median_s": statistics.median(peer),
        "speedup": statistics.median(recompute) / statistics.median(peer),
        "transfer": sent,
    }
    write_json(Path(args.out), result)
    print(
        f"{args.prompt_tokens}-token prefix, {args.connector}: recompute "
        f"{result['recompute_median_s'] * 1e3:.1f} ms, from the peer "
        f"{result['peer_median_s'] * 1e3:.1f} ms ({result['speedup']:.1f}x)"
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--connector", default="shm", choices=["shm", "p2p", "object_store"])
    p.add_argument("--prompt-tokens", type=count, default=2000)
    p.add_argument("--repeats", type=count, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/peer_prefill.json")
    p.set_defaults(func=run)
