"""The benchmark commands parse, and every cluster setup they build is a valid config."""

from __future__ import annotations

import os

import pytest

from pdserve.bench.headline import MODES, ClusterSetup, check_cores, cluster_setup
from pdserve.cluster.config import parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.options import options_from
from pdserve.deploy.cli import build_parser


@pytest.mark.parametrize("command", ["disagg-vs-colocated", "peer"])
@pytest.mark.parametrize("mode", MODES)
def test_each_setup_is_a_valid_cluster(command: str, mode: str) -> None:
    args = options_from(
        ClusterSetup, build_parser().parse_args(["bench", command, "--cores", "0", "1"])
    )
    text, pins = cluster_setup(mode, args)
    config = parse_config(text, f"{command}-{mode}")
    (region,) = config.regions
    if mode == "colocated":
        assert region.prefill.count == 0 and pins == {"decode": (0, 1)}
        assert config.disaggregation.local_prefill_max_tokens >= 1_000_000
    else:
        assert region.prefill.count == 1 and pins == {"prefill": (0,), "decode": (1,)}
        assert config.disaggregation.local_prefill_max_tokens == 0
        budget = config.engine_config("prefill", region).scheduler.max_num_batched_tokens
        assert budget == args.prefill_max_num_batched_tokens


def test_cores_are_distinct_usable_and_two_for_disaggregated() -> None:
    # checked before a cluster starts: a lone core used to reach the disaggregated
    # setup after the colocated one had run, and a core not on this host reached Ray
    usable = sorted(os.sched_getaffinity(0))
    check_cores(usable[:1], ["colocated"])
    for cores, modes, message in (
        ([0, 0], ["colocated"], "distinct"),
        ([], ["colocated"], "distinct"),
        ([max(usable) + 1], ["colocated"], "not usable here"),
        (usable[:1], list(MODES), "needs two cores"),
    ):
        with pytest.raises(InvalidArgumentError, match=f"cores: .*{message}"):
            check_cores(cores, modes)
