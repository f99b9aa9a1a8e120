"""CUDA IPC connector (KV caches on GPUs of one node).

The decode rank allocates its KV cache on its GPU and publishes a CUDA IPC
handle of that memory (torch's own, as ``torch.multiprocessing`` shares CUDA
tensors: :class:`IpcHandle`). A prefill rank on the same node opens the handle
once, at ``connect``, and from then on copies each layer's pages straight
from its cache into the reserved pages of the decode rank's: device-to-device
copies queued on the prefill rank's current stream, right behind the layer
that wrote the pages, with no host synchronisation. ``flush``, at the end of
the step, waits for that stream: the pages have landed when it returns.

A GPU is named by its UUID, not by its index: each process may see its GPUs
under other indices (``CUDA_VISIBLE_DEVICES``), so the sender opens the handle
on the local index whose UUID matches, and refuses a decode rank whose GPU it
cannot see. Ray narrows each actor's ``CUDA_VISIBLE_DEVICES`` to its own GPUs,
so under Ray this connector serves instances that share a GPU; instances on
different GPUs use ``nccl`` (device to device over an NCCL pair group) or ``p2p``
(which stages GPU pages through host memory); ``auto`` does not pick ``nccl`` yet.

A run's pages are copied with one gather and one scatter (``index_select`` /
``index_copy_`` over page-major views), two kernels whatever the pages'
fragmentation; the block ids go to the GPU from pinned memory without a wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.core.errors import TransferError
from pdserve.transfer.connector import KVReceiver, KVSender, register
from pdserve.transfer.handshake import PeerEndpoint
from pdserve.transfer.wire import PageHeader, PageRun, PageSource, dtype_name, torch_dtype

# Where the device index sits in the arguments of torch's rebuild_cuda_tensor
# (torch.multiprocessing.reductions.reduce_tensor); checked by _device_at.
_DEVICE_ARG = 6


@dataclass(frozen=True)
class IpcHandle:
    """A CUDA tensor as another process on the node can open it."""

    rebuild_args: tuple[Any, ...]  # reduce_tensor's, for rebuild_cuda_tensor
    device_uuid: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> IpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(tensor)
        _device_at(args, tensor.device.index)
        return cls(tuple(args), device_uuid(tensor.device.index))

    def open(self) -> torch.Tensor:
        """The tensor, mapped into this process on the GPU with the same UUID."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        local = local_index(self.device_uuid)
        args = list(self.rebuild_args)
        args[_DEVICE_ARG] = local
        with torch.cuda.device(local):
            return rebuild_cuda_tensor(*args)


def _device_at(args: tuple[Any, ...], index: int | None) -> None:
    if len(args) <= _DEVICE_ARG or args[_DEVICE_ARG] != index:
        raise TransferError(
            "this torch shares CUDA tensors in a form the cuda_ipc connector does not know "
            f"(device index not at argument {_DEVICE_ARG})"
        )


def device_uuid(index: int | None) -> str:
    return str(torch.cuda.get_device_properties(index or 0).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU called ``uuid``."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise TransferError(
        f"the decode rank's GPU {uuid} is not visible to this prefill rank (another node, "
        "or hidden by CUDA_VISIBLE_DEVICES, which Ray narrows to each actor's own GPUs): "
        "use the p2p connector, or let both ranks see both GPUs"
    )


def block_index(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as a device tensor, sent without making the host wait."""
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long, device=device)
    host = torch.tensor(ids, dtype=torch.long, pin_memory=True)
    return host.to(device, non_blocking=True)


def place_runs(layers: list[torch.Tensor], runs: list[PageRun]) -> int:
    """Copy one message's runs into ``layers`` (page-major, ``[blocks, 2, bs, heads, D]``).

    Returns the bytes copied. Every run is checked before any is copied: a message
    with a run that does not fit raises TransferError and moves nothing.
    """
    placed = [_fitted(layers, header, source) for header, source in runs]
    for (header, source), (src, dst) in zip(runs, placed, strict=True):
        src_ids = block_index(source.block_ids, src.device)
        dst_ids = block_index(header.block_ids, dst.device)
        dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))
    return sum(source.nbytes for _, source in runs)


def _fitted(
    layers: list[torch.Tensor], header: PageHeader, source: PageSource
) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's source and destination pages, page-major; TransferError if they do not fit."""
    if len(header.block_ids) != len(source.block_ids):
        raise TransferError(
            f"{len(source.block_ids)} source pages for {len(header.block_ids)} "
            f"destination pages of {header.request_id}"
        )
    if not 0 <= header.layer < len(layers):
        raise TransferError(f"layer {header.layer} of {len(layers)} for {header.request_id}")
    dst = layers[header.layer]
    h0, h1 = header.head_start, header.head_end
    if (h0, h1) != (0, dst.shape[3]):
        dst = dst[:, :, :, h0:h1]
    src = source.pages
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise TransferError(
            f"pages of {header.request_id} are {list(src.shape[1:])} {src.dtype}, "
            f"the decode rank's {list(dst.shape[1:])} {dst.dtype}"
        )
    _check_ids(header.request_id, source.block_ids, src.shape[0], "prefill")
    _check_ids(header.request_id, header.block_ids, dst.shape[0], "decode")
    return src, dst


def _check_ids(request_id: str, ids: list[int], blocks: int, side: str) -> None:
    # on the host: an index out of range on the GPU is a device-side assert, which
    # ends the process's CUDA context
    if ids and (min(ids) < 0 or max(ids) >= blocks):
        raise TransferError(
            f"pages of {request_id} outside the {side} rank's {blocks} blocks: {ids}"
        )


class CudaIpcReceiver(KVReceiver):
    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if device.type != "cuda":
            raise TransferError(
                f"the cuda_ipc connector needs the KV cache on a CUDA device, not {device}: "
                "use the shm connector"
            )
        return super().allocate(shape, dtype, device)

    def endpoint(self, actor: Any) -> PeerEndpoint:
        assert self.kv_cache is not None
        return PeerEndpoint(
            "cuda_ipc",
            self.instance_id,
            self.rank,
            tuple(self.kv_cache.shape),
            dtype_name(self.kv_cache.dtype),
            IpcHandle.of(self.kv_cache),
        )


class CudaIpcSender(KVSender):
    def __init__(self) -> None:
        super().__init__()
        # Per decode rank: each local layer of its cache, page-major.
        self._layers: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._devices: set[torch.device] = set()  # whose streams the queued copies are on
        self._queued: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    def connect(self, endpoint: PeerEndpoint) -> None:
        super().connect(endpoint)
        if not isinstance(endpoint.address, IpcHandle):
            raise TransferError(f"{endpoint.instance_id}/{endpoint.rank} sent no CUDA IPC handle")
        cache = endpoint.address.open()
        if tuple(cache.shape) != tuple(endpoint.kv_shape) or cache.dtype != torch_dtype(
            endpoint.dtype
        ):
            raise TransferError(
                f"the KV cache of {endpoint.instance_id}/{endpoint.rank} opened as "
                f"{list(cache.shape)} {cache.dtype}, announced {list(endpoint.kv_shape)} "
                f"{endpoint.dtype}"
            )
        key = (endpoint.instance_id, endpoint.rank)
        self._layers[key] = [layer.transpose(0, 1) for layer in cache.unbind(0)]

    def send(self, peer: tuple[str, int], runs: list[PageRun]) -> None:
        layers = self._layers[peer]
        device = runs[0][1].cache.device if runs else layers[0].device
        timing = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timing[0].record()
        try:
            nbytes = place_runs(layers, runs)
        except (RuntimeError, IndexError) as e:
            self.stats.failures += 1
            raise TransferError(f"CUDA IPC copy to {peer} failed: {e}") from e
        timing[1].record()
        self._queued.append((*timing, nbytes))
        self._devices.update((device, layers[0].device))

    def flush(self) -> None:
        """Wait for the copies queued since the last flush, then count them.

        A message's time is its copies' time on the GPU (CUDA events around them).
        """
        try:
            for device in self._devices:
                torch.cuda.current_stream(device).synchronize()
        except RuntimeError as e:
            self.stats.failures += 1
            raise TransferError(f"CUDA IPC copies failed: {e}") from e
        for start, end, nbytes in self._queued:
            self.stats.add(nbytes, start.elapsed_time(end) / 1000)
        self._queued.clear()
        self._devices.clear()

    def disconnect(self, instance_id: str) -> None:
        super().disconnect(instance_id)
        for key in [k for k in self._layers if k[0] == instance_id]:
            del self._layers[key]

    def close(self) -> None:
        self._layers.clear()


register("cuda_ipc", CudaIpcSender, CudaIpcReceiver)
