"""KV pages from a prefill process into a decode process's pool over CUDA IPC (CUDA only).

    pdserve bench cuda-ipc --out bench/out/cuda_ipc.json

The decode side, a process of its own, allocates its paged KV pool
(``[layers, 2, blocks, block_size, kv_heads, head_dim]``, Llama-3-8B's shape, bf16)
and hands it to the prefill side, this process, through ``torch.multiprocessing``,
which shares a CUDA tensor as a CUDA IPC handle of its memory. The prefill side then
writes a prompt's pages into pages scattered over that pool, layer by layer (one
``index_copy_`` per layer, as a layer-wise connector sends), timed against the same
copies into a pool of its own (a device-to-device copy inside one process) and
against the plain copy bandwidth; then the same pages through the shipped
``cuda_ipc`` connector (``CudaIpcSender``: a message a layer, then ``flush``),
into the pool its receiver allocated and published. The decode side checks every
page the connector delivered (an exact integer sum of the bits).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.flags import count
from pdserve.bench.kernels import HEAD_DIM, KV_HEADS, LAYERS, copy_bandwidth, median_ms
from pdserve.bench.report import machine_info, write_json
from pdserve.core.options import options_from
from pdserve.transfer.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from pdserve.transfer.wire import PageHeader, PageSource

BLOCK = 16
PEER = ("decode", 0)


@dataclass(frozen=True)
class CudaIpcOptions:
    """``pdserve bench cuda-ipc``'s options, in the order of its flags."""

    tokens: list[int] = field(default_factory=lambda: [512, 2048, 8192])  # prompt lengths
    pool_pages: int = 4096  # decode pool, in pages
    seed: int = 0  # seeds the KV values
    out: str = "bench/out/cuda_ipc.json"  # the result file


def bits_sum(pages: torch.Tensor) -> int:
    """An exact checksum of bf16 pages: the sum of their 16-bit patterns."""
    return int(pages.contiguous().view(torch.int16).long().sum().item())


def decode_side(shape: tuple[int, ...], to_prefill: Any, from_prefill: Any) -> None:
    """The decode instance: its pool, shared, and the cuda_ipc connector's endpoint of it;
    then, per prompt sent, its pages' checksum."""
    receiver = CudaIpcReceiver("decode", 0)
    pool = receiver.allocate(shape, torch.bfloat16, torch.device("cuda"))
    to_prefill.put((pool, receiver.endpoint(None)))
    while (pages := from_prefill.get()) is not None:
        to_prefill.put(bits_sum(pool[:, :, pages.cuda()]))


def write_layers(pool: torch.Tensor, src: torch.Tensor, pages: torch.Tensor) -> None:
    for layer in range(src.shape[0]):
        pool[layer].index_copy_(1, pages, src[layer])


def send_layers(sender: CudaIpcSender, src: torch.Tensor, pages: list[int]) -> None:
    """One prompt's pages through the connector, a message a layer, as a prefill rank sends."""
    n = len(pages)
    for layer in range(src.shape[0]):
        header = PageHeader(
            "r", layer, pages, "bfloat16", [2, n, BLOCK, KV_HEADS, HEAD_DIM], 0, KV_HEADS
        )
        sender.send(PEER, [(header, PageSource(src[layer], list(range(n)), 0, KV_HEADS))])
    sender.flush()


def one_prompt(
    remote: torch.Tensor,
    local: torch.Tensor,
    tokens: int,
    channel: tuple[Any, Any],
    sender: CudaIpcSender,
) -> dict[str, Any]:
    to_prefill, from_prefill = channel
    n = -(-tokens // BLOCK)
    src = torch.randn(LAYERS, 2, n, BLOCK, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
    pages = torch.randperm(remote.shape[2], device="cuda")[:n]
    ipc_ms = median_ms(lambda: write_layers(remote, src, pages))
    local_ms = median_ms(lambda: write_layers(local, src, pages))
    ids = pages.tolist()
    connector_ms = median_ms(lambda: send_layers(sender, src, ids))
    remote.zero_()
    send_layers(sender, src, ids)  # what the decode side checks: the connector's pages
    torch.cuda.synchronize()
    from_prefill.put(pages.cpu())
    received = to_prefill.get(timeout=60)
    nbytes = src.numel() * src.element_size()
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "ipc_ms": round(ipc_ms, 3),
        "ipc_gb_s": round(nbytes / ipc_ms / 1e6, 1),
        "local_ms": round(local_ms, 3),
        "local_gb_s": round(nbytes / local_ms / 1e6, 1),
        "ipc_over_local": round(ipc_ms / local_ms, 2),
        # the shipped connector (transfer/cuda_ipc.py), flush included
        "connector_ms": round(connector_ms, 3),
        "connector_gb_s": round(nbytes / connector_ms / 1e6, 1),
        "pages_match": received == bits_sum(src),
    }


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(CudaIpcOptions, args))


def benchmark(args: CudaIpcOptions) -> int:
    """Each prompt length's pages into the other process's pool and copied in one; written."""
    if not torch.cuda.is_available():
        raise SystemExit("pdserve bench cuda-ipc needs a CUDA GPU, and none is visible here")
    import torch.multiprocessing as mp

    torch.manual_seed(args.seed)
    shape = (LAYERS, 2, args.pool_pages, BLOCK, KV_HEADS, HEAD_DIM)
    ctx = mp.get_context("spawn")
    to_prefill, from_prefill = ctx.Queue(), ctx.Queue()
    decode = ctx.Process(target=decode_side, args=(shape, to_prefill, from_prefill))
    decode.start()
    try:
        remote, endpoint = to_prefill.get(timeout=120)
        sender = CudaIpcSender()
        sender.connect(endpoint)
        local = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        bandwidth = copy_bandwidth(torch.device("cuda"))
        rows = []
        for tokens in args.tokens:
            rows.append(one_prompt(remote, local, tokens, (to_prefill, from_prefill), sender))
            print(json.dumps(rows[-1]), flush=True)
        sender.close()
        del remote
        from_prefill.put(None)
        decode.join(timeout=60)
    finally:
        if decode.is_alive():
            decode.kill()
    report = {
        "command": "pdserve bench cuda-ipc --tokens "
        + " ".join(map(str, args.tokens))
        + f" --pool-pages {args.pool_pages}",
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name(0)},
        "plain_copy_gb_s": round(bandwidth / 2e9, 1),  # bytes copied per second
        "rows": rows,
    }
    out = write_json(Path(args.out), report)
    print(f"wrote {out}")
    return 0 if all(r["pages_match"] for r in rows) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=count, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--pool-pages", type=count, default=4096, help="decode pool, in pages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/cuda_ipc.json")
    p.set_defaults(func=run)
