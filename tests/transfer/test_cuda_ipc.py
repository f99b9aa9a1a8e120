"""The CUDA IPC connector: its page placement everywhere, its handles on a GPU.

The placement (one gather and one scatter per run) is checked page by page
against the shared-memory cases of ``test_page_copy`` on the CPU. The rest
needs CUDA and is skipped without it (CI has none): a decode rank's cache,
allocated in a process of its own, is filled by this process through the
handle it published, layer by layer, re-sharded between TP sizes by
:class:`RankTransfer` as in ``test_rank``. Nothing here imports Ray, so
``make gpu-check`` runs it on a bare GPU machine.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

from pdserve.core.errors import TransferError
from pdserve.core.layout import Layout
from pdserve.core.step import KVSend, ScheduledSeq, StepPlan
from pdserve.transfer import connector_classes
from pdserve.transfer.cuda_ipc import CudaIpcReceiver, IpcHandle, place_runs
from pdserve.transfer.rank import RankTransfer
from tests.transfer.test_page_copy import CASES, HEADS, caches, expected, runs_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def page_major(cache: torch.Tensor) -> list[torch.Tensor]:
    return [layer.transpose(0, 1) for layer in cache.unbind(0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_page_lands_in_its_slot(case: str, dtype: torch.dtype) -> None:
    source, dest = caches(dtype)
    want = expected(source, dest, CASES[case])
    nbytes = place_runs(page_major(dest), runs_of(source, CASES[case]))
    assert torch.equal(dest, want)
    assert nbytes == sum(source.nbytes for _, source in runs_of(source, CASES[case]))


@pytest.mark.parametrize(
    "src, dst, side",
    [([0, 12], [0, 1], "prefill"), ([0, 1], [11, 12], "decode"), ([-1], [0], "prefill")],
)
def test_a_page_outside_either_cache_is_refused_before_any_copy(src, dst, side) -> None:
    source, dest = caches(torch.float32)
    spec = [
        ("r1", 0, 0, [2], (0, HEADS), [3], (0, HEADS)),
        ("r2", 0, 0, src, (0, HEADS), dst, (0, HEADS)),
    ]
    with pytest.raises(TransferError, match=f"pages of r2 outside the {side} rank's 12 blocks"):
        place_runs(page_major(dest), runs_of(source, spec))
    assert (dest == -1).all()


def test_a_run_of_another_shape_or_count_is_refused() -> None:
    source, dest = caches(torch.float32)
    with pytest.raises(TransferError, match="2 source pages for 1 destination pages of r1"):
        place_runs(page_major(dest), runs_of(source, [("r1", 0, 0, [0, 1], (0, 2), [4], (0, 2))]))
    with pytest.raises(TransferError, match="layer 5 of 3 for r1"):
        place_runs(page_major(dest), runs_of(source, [("r1", 0, 5, [0], (0, 2), [4], (0, 2))]))
    with pytest.raises(TransferError, match=r"pages of r1 are \[2, 4, 2, 8\]"):
        place_runs(page_major(dest), runs_of(source, [("r1", 0, 0, [0], (0, 2), [4], (0, 1))]))
    assert (dest == -1).all()


def test_a_cache_in_host_memory_is_refused_with_the_connector_to_use() -> None:
    _, receiver_cls = connector_classes("cuda_ipc")
    assert receiver_cls is CudaIpcReceiver
    with pytest.raises(
        TransferError, match="needs the KV cache on a CUDA device, not cpu: use the shm"
    ):
        CudaIpcReceiver("d0", 0).allocate((1, 2, 4, 4, 2, 8), torch.float32, torch.device("cpu"))


# ---- on a GPU ---------------------------------------------------------------

LAYERS, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 4, 4, 64, 16, 8
PREFILL = Layout(2, 1, 1, ((0, LAYERS),))  # TP=2: two KV heads a rank
DECODE = Layout(1, 1, 1, ((0, LAYERS),))
SRC_BLOCKS, DST_BLOCKS = [1, 2, 5, 40], [60, 0, 33, 7]


def decode_process(to_prefill: Any, from_prefill: Any) -> None:
    """A decode rank: its cache, its endpoint; then the pages it holds, back as a host tensor."""
    decode = RankTransfer("d0", 0, DECODE, KV_HEADS, "cuda_ipc")
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    decode.receiver.allocate(shape, torch.bfloat16, torch.device("cuda"))
    to_prefill.put(decode.receiver.endpoint(None))
    from_prefill.get()  # the senders flushed
    assert decode.receiver.kv_cache is not None
    to_prefill.put(decode.receiver.kv_cache.cpu())
    from_prefill.get()  # the senders let go of the cache before it is freed
    decode.close()


@needs_cuda
def test_pages_reach_a_decode_rank_in_another_process_resharded() -> None:
    ctx = mp.get_context("spawn")
    to_prefill, from_prefill = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=decode_process, args=(to_prefill, from_prefill))
    child.start()
    try:
        endpoint = to_prefill.get(timeout=120)
        assert isinstance(endpoint.address, IpcHandle)
        prefills = []
        plan = StepPlan(
            1,
            [ScheduledSeq("r1", [3] * 60, 0, SRC_BLOCKS)],
            kv_sends=[KVSend("r1", "d0", SRC_BLOCKS, DST_BLOCKS, True)],
        )
        for rank in range(2):
            prefill = RankTransfer("p0", rank, PREFILL, KV_HEADS, "cuda_ipc")
            shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
            prefill.kv_cache = torch.randn(shape, device="cuda").bfloat16()
            prefill.pair(DECODE, [endpoint])
            for layer in range(LAYERS):
                prefill.on_layer(layer, plan)
            assert prefill.after_step(plan)  # flushed: the pages are in place
            stats = prefill.sender.stats
            assert stats.messages == LAYERS and stats.seconds > 0
            assert stats.bytes == LAYERS * 2 * len(SRC_BLOCKS) * BLOCK_SIZE * 2 * HEAD_DIM * 2
            prefills.append(prefill)
        from_prefill.put("flushed")
        got = to_prefill.get(timeout=120)
        for rank, prefill in enumerate(prefills):
            assert prefill.kv_cache is not None
            heads = slice(2 * rank, 2 * rank + 2)
            want = prefill.kv_cache[:, :, SRC_BLOCKS].cpu()
            assert torch.equal(got[:, :, DST_BLOCKS, :, heads], want)
            prefill.close()
        untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
        assert got[:, :, untouched].abs().sum() == 0
        from_prefill.put("closed")
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
