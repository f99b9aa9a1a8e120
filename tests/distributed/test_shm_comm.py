"""Shared-memory collectives in real processes, against torch's own gloo results."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.distributed import shm_comm
from pdserve.distributed.shm_comm import ShmCollectiveError, ShmCommunicator, open_group_shm

SLOT_BYTES = 4096  # small, so that the larger sizes below go through in chunks
SIZES = [1, 7, 1001, 5000]  # one element, odd, just under a float32 slot, several slots
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.skipif(not shm_comm.shm_supported()[0], reason="no shm collectives here")


def _join(rank: int, world: int, store: str, timeout_s: float = 30) -> ShmCommunicator:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    comm, why = open_group_shm(
        dist.group.WORLD, list(range(world)), rank, timeout_s, slot_bytes=SLOT_BYTES
    )
    assert comm is not None, why
    if rank == 0:
        assert not Path(comm.path).exists(), "the creator unlinks the file once all ranks map it"
    return comm


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype)


def _check_against_gloo(rank: int, world: int, store: str) -> None:
    comm = _join(rank, world, store)
    exact = world == 2  # gloo's ring sums 3+ ranks in another order
    for dtype in DTYPES:
        for n in SIZES:
            x = _inputs(rank, n, dtype)
            ours, theirs = x.clone(), x.clone()
            comm.all_reduce(ours)
            dist.all_reduce(theirs)
            _same(ours, theirs, exact, f"all_reduce {dtype} {n}")
            everyone = [torch.empty_like(ours) for _ in range(world)]
            dist.all_gather(everyone, ours)
            assert all(torch.equal(e, ours) for e in everyone), "ranks disagree on the sum"

            gathered = comm.all_gather(x)
            expected = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(expected, x)
            assert torch.equal(gathered, torch.stack(expected)), f"all_gather {dtype} {n}"

            src = world - 1
            ours, theirs = x.clone(), x.clone()
            comm.broadcast(ours, src)
            dist.broadcast(theirs, src)
            assert torch.equal(ours, theirs), f"broadcast {dtype} {n}"
    _check_shapes(comm, rank, world)
    dist.destroy_process_group()


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(a, b), what
    else:
        # Another order of three roundings: a few units in the last place apart.
        tol = 0.05 if a.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)


def _check_shapes(comm: ShmCommunicator, rank: int, world: int) -> None:
    """Non-contiguous tensors, 2-D gathers and byte messages of every size."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)  # not contiguous
    comm.all_reduce(x)
    assert torch.equal(x, torch.arange(12.0).reshape(3, 4).t() * sum(range(1, world + 1)))
    y = torch.full((2, 3), float(rank))
    assert torch.equal(
        comm.all_gather(y), torch.stack([torch.full((2, 3), float(r)) for r in range(world)])
    )
    for payload in [None, b"", b"plan", bytes(range(256)) * 40]:  # the last spans 3 slots
        got = comm.broadcast_bytes(payload if rank == 0 else b"wrong")
        assert got == payload


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_gloo(tmp_path: Path, world: int) -> None:
    mp.spawn(_check_against_gloo, args=(world, str(tmp_path / "store")), nprocs=world)


def _peer_dies(rank: int, world: int, store: str, out: str) -> None:
    comm = _join(rank, world, store, timeout_s=60)
    comm.all_reduce(torch.ones(4))  # one good call first
    if rank == 1:
        os._exit(0)  # killed mid-run: no clean-up of any kind
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except ShmCollectiveError as e:
        Path(out).write_text(f"{time.monotonic() - start:.3f} {e}")
    with pytest.raises(ShmCollectiveError, match="unusable"):
        comm.all_gather(torch.ones(4))  # a failed communicator refuses later calls


def test_dead_peer_makes_a_collective_raise_quickly(tmp_path: Path) -> None:
    out = tmp_path / "result"
    mp.spawn(_peer_dies, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    seconds, message = out.read_text().split(" ", 1)
    assert "group rank 1" in message and "died" in message
    assert float(seconds) < 2.0  # far inside the 60 s collective timeout


def _peer_stalls(rank: int, world: int, store: str, out: str) -> None:
    comm = _join(rank, world, store, timeout_s=30)
    comm.timeout_s = 0.5
    if rank == 1:
        time.sleep(3)  # alive, but never joins the collective in time
        return
    start = time.monotonic()
    with pytest.raises(ShmCollectiveError, match="timed out") as err:
        comm.all_reduce(torch.ones(4))
    Path(out).write_text(f"{time.monotonic() - start:.3f} {err.value}")


def test_stuck_peer_times_out(tmp_path: Path) -> None:
    out = tmp_path / "result"
    mp.spawn(_peer_stalls, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    seconds, message = out.read_text().split(" ", 1)
    assert "group ranks [1]" in message
    assert 0.5 <= float(seconds) < 2.0


def _split_hosts(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    shm_comm.host_key = lambda: f"host-{rank}"  # type: ignore[assignment]
    comm, why = open_group_shm(dist.group.WORLD, [0, 1], rank, 30)
    assert comm is None and "different hosts" in why
    dist.barrier()  # neither rank tears gloo down while the other still uses it
    dist.destroy_process_group()


def test_ranks_on_different_hosts_stay_on_gloo(tmp_path: Path) -> None:
    mp.spawn(_split_hosts, args=(2, str(tmp_path / "store")), nprocs=2)
    assert not list(Path("/dev/shm").glob(f"pdserve-coll-{os.getpid()}-*"))


def test_the_switch_is_read_where_the_spec_is_built(monkeypatch) -> None:
    from pdserve.parallel.rank_spec import RankSpec

    fields = dict(rank=0, layout=None, model=None, engine=None)
    monkeypatch.setenv("PDSERVE_SHM_COLLECTIVES", "0")
    assert RankSpec(**fields).shm_collectives is False  # type: ignore[arg-type]
    monkeypatch.delenv("PDSERVE_SHM_COLLECTIVES")
    assert RankSpec(**fields).shm_collectives is True  # type: ignore[arg-type]


def test_segment_is_private_from_its_creation(monkeypatch) -> None:
    """0600 before any peer attaches, whatever the umask: a process of another user that
    opened it during set-up would read every later all-reduce."""
    seen: list[int] = []
    mapped = ShmCommunicator.__init__

    def watch(self, path, *args, **kwargs):  # the mode when the creator first maps it
        seen.append(os.stat(path).st_mode & 0o777)
        mapped(self, path, *args, **kwargs)

    monkeypatch.setattr(ShmCommunicator, "__init__", watch)
    path = shm_comm.SHM_DIR / f"pdserve-coll-{os.getpid()}-{os.urandom(6).hex()}"
    old = os.umask(0o022)
    try:
        comm = ShmCommunicator.create(str(path), 2, SLOT_BYTES, timeout_s=1.0)
    finally:
        os.umask(old)
    try:
        assert seen == [0o600]
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        comm.close()
        path.unlink(missing_ok=True)
