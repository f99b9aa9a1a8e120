"""The Ray actor class of instance ranks: every call of the rank's worker is forwarded on
the worker's concurrency group, and a process that imports the class (any process
holding a handle to a rank) imports neither torch nor the rank's code, nor (holding a
router's) the router's."""

from __future__ import annotations

import inspect
import subprocess
import sys

from pdserve.cluster.instance_actor import CALLS, InstanceActor


def test_every_public_call_of_the_worker_is_forwarded_on_its_group() -> None:
    from pdserve.cluster.worker import InstanceWorker

    methods = {
        name: getattr(method, "__ray_concurrency_group__", None)
        for name, method in inspect.getmembers(InstanceWorker, inspect.isfunction)
        if not name.startswith("_")
    }
    assert methods == CALLS, "list each InstanceWorker call in pdserve.cluster.instance_actor"
    for name, group in CALLS.items():
        forwarded = getattr(InstanceActor, name)
        assert forwarded.__name__ == name
        assert getattr(forwarded, "__ray_concurrency_group__", None) == group, name


def test_the_classes_whose_handles_ranks_and_routers_hold_load_nothing_heavy() -> None:
    """Ray imports an actor class's module wherever a handle to the actor arrives: a
    router holds the ranks', a rank the router's."""
    code = (
        "import sys, pdserve.cluster.instance_actor, pdserve.router.actor\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'aiohttp', 'triton')"
        " or m in ('pdserve.cluster.worker', 'pdserve.router.router')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
