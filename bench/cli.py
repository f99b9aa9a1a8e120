"""``pdserve bench`` subcommands."""

from __future__ import annotations

import argparse

BENCH_HELP = "benchmarks (see bench/RESULTS.md)"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help=BENCH_HELP)
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    from pdserve.bench import (
        afd,
        coldstart,
        disagg_ttft,
        elastic,
        eplb,
        headline,
        kernels,
        multiturn,
        offline,
        parallel,
        peer,
        peer_prefill,
        priority,
        quant,
        router,
        scheduler,
        serve,
        soak,
        spec,
        startup,
        transfer,
        weights,
    )

    offline.add_parser(kinds)
    parallel.add_parser(kinds)
    transfer.add_parser(kinds)
    disagg_ttft.add_parser(kinds)
    router.add_parser(kinds)
    scheduler.add_parser(kinds)
    kernels.add_parser(kinds)
    serve.add_parser(kinds)
    headline.add_parser(kinds)
    peer.add_parser(kinds)
    peer_prefill.add_parser(kinds)
    soak.add_parser(kinds)
    quant.add_parser(kinds)
    multiturn.add_parser(kinds)
    priority.add_parser(kinds)
    spec.add_parser(kinds)
    eplb.add_parser(kinds)
    elastic.add_parser(kinds)
    afd.add_parser(kinds)
    coldstart.add_parser(kinds)
    weights.add_parser(kinds)
    startup.add_parser(kinds)
