"""Each command's options dataclass holds every flag its parser has, by the same name.

The handlers build their options with :func:`pdserve.core.options.options_from`,
which reads fields by name and leaves other flags out: a flag with no field would
reach nothing below the handler, and would be missing from the options a result
file records.
"""

from __future__ import annotations

import importlib

import pytest

from pdserve.core.options import flat_options, options_from
from pdserve.deploy.cli import build_parser

# argparse's own entries: the dispatch, the command's name, the logging flag
PLUMBING = {"func", "prog", "command", "bench_command", "log_level"}
# fields that no flag sets: what a run finds and records beside its flags
FOUND = {"PriorityOptions": {"vocab", "capacity"}}

COMMANDS = [
    ("bench serve --target grpc://h:1", "pdserve.bench.serve", "ServeOptions"),
    ("bench disagg-vs-colocated", "pdserve.bench.headline", "HeadlineOptions"),
    ("bench peer", "pdserve.bench.peer", "PeerOptions"),
    ("bench soak", "pdserve.bench.soak", "SoakOptions"),
    ("bench gpu", "pdserve.bench.gpu", "GpuOptions"),
    ("bench kernels", "pdserve.bench.kernels", "KernelsOptions"),
    ("bench afd", "pdserve.bench.afd", "AfdOptions"),
    ("bench elastic", "pdserve.bench.elastic", "ElasticOptions"),
    ("bench coldstart", "pdserve.bench.coldstart", "ColdstartOptions"),
    ("bench startup", "pdserve.bench.startup", "StartupOptions"),
    ("bench multiturn", "pdserve.bench.multiturn", "MultiturnOptions"),
    ("bench offline", "pdserve.bench.offline", "OfflineOptions"),
    ("bench parallel", "pdserve.bench.parallel", "ParallelOptions"),
    ("bench quant", "pdserve.bench.quant", "QuantOptions"),
    ("bench spec", "pdserve.bench.spec", "SpecOptions"),
    ("bench ttft", "pdserve.bench.disagg_ttft", "TtftOptions"),
    ("bench priority", "pdserve.bench.priority", "PriorityOptions"),
    ("bench cuda-ipc", "pdserve.bench.cuda_ipc", "CudaIpcOptions"),
    ("bench eplb", "pdserve.bench.eplb", "EplbOptions"),
    ("bench peer-prefill", "pdserve.bench.peer_prefill", "PeerPrefillOptions"),
    ("bench router", "pdserve.bench.router", "RouterOptions"),
    ("bench sampler", "pdserve.bench.sampler", "SamplerOptions"),
    ("bench scheduler", "pdserve.bench.scheduler", "SchedulerOptions"),
    ("bench transfer", "pdserve.bench.transfer", "TransferOptions"),
    ("bench weights", "pdserve.bench.weights", "WeightsOptions"),
    ("afd-estimate", "pdserve.sim.afd", "EstimateOptions"),
    ("sim --config c.yaml", "pdserve.sim.cli", "SimFlags"),
    ("profile", "pdserve.sim.cli", "ProfileFlags"),
    ("sim-validate", "pdserve.sim.validate_options", "ValidateOptions"),
    ("sim-planners --config c.yaml --rate 1", "pdserve.sim.replay_cli", "PlannersFlags"),
    ("plan --model llama-7b", "pdserve.sim.plan_cli", "PlanFlags"),
    ("generate", "pdserve.deploy.cli", "GenerateOptions"),
    ("rollout", "pdserve.deploy.rollout_cli", "RolloutOptions"),
]


@pytest.mark.parametrize(("argv", "module", "name"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_the_options_hold_every_flag_of_the_command(argv: str, module: str, name: str) -> None:
    words = argv.split()
    parsed = build_parser(words[0]).parse_args(words)
    options = options_from(getattr(importlib.import_module(module), name), parsed)
    flags = set(vars(parsed)) - PLUMBING
    fields = set(flat_options(options)) - PLUMBING - FOUND.get(name, set())
    assert flags == fields, (
        f"flags without a field: {sorted(flags - fields)}; fields no flag sets "
        f"(derived, or a default another parser gives): {sorted(fields - flags)}"
    )
