"""Decode steps replayed from CUDA graphs.

A decode step of a large model launches hundreds of small kernels, and at small
batches launching them takes longer than running them: on an H200, a Llama-3-8B-shaped
step of one sequence over 1,024 tokens took 15.7 ms launched eagerly and 4.9 ms
replayed from a graph, against a 3.6 ms floor of reading its weights and KV once
(``pdserve bench gpu``, docs/results/gpu.md).

A step is replayed when every row has one new token (no prompt chunk, no draft), no
row runs a LoRA adapter and none asks for prompt logprobs, on a single CUDA rank: its
forward and logits then depend only on fixed-shape tensors once the batch is padded
to a bucket and the attention's split of the context is planned for a power-of-two
bound on it. One graph per (batch bucket, context bound), captured the first time
a step needs it, all in one memory pool. Padding rows write no KV (slot -1) and
read one token of page 0; their logits are dropped. Sampling stays outside the
graph. A model whose forward cannot be captured (a host synchronisation in it)
runs eagerly from then on, with a warning.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.kernels.attention.backend import AttentionMetadata

if TYPE_CHECKING:
    from pdserve.models.families import CausalLM
    from pdserve.parallel.batch import PreparedBatch

logger = logging.getLogger(__name__)


class Replayable(Protocol):
    def replay(self) -> None: ...


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT = 256  # the smallest context bound a graph is planned for


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The padded batch sizes: the standard ones below ``max_num_seqs``, then it."""
    return [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]


def context_bound(max_seq_len: int, limit: int) -> int:
    """The power of two at or above ``max_seq_len`` (at least MIN_CONTEXT), at most ``limit``."""
    bound = MIN_CONTEXT
    while bound < max_seq_len:
        bound *= 2
    return min(bound, limit)


class DecodeGraphs:
    """The graphs of one runner's decode steps and the static inputs they read."""

    def __init__(
        self,
        model: CausalLM,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.caches, self.block_size = model, caches, block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.limit = -(-max_model_len // block_size) * block_size
        rows, self.max_blocks = self.buckets[-1], self.limit // block_size
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self.start_loc = torch.zeros(1, dtype=torch.int32, device=device)
        self.no_prefill = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self.pool: Any = None  # the graphs' memory pool, made at the first capture
        self.graphs: dict[tuple[int, int], tuple[Replayable, torch.Tensor]] = {}
        self.broken = False

    def fits(self, batch: PreparedBatch) -> bool:
        meta = batch.meta
        return (
            not self.broken
            and meta.num_prefills == 0
            and 0 < batch.num_tokens <= self.buckets[-1]
            and batch.num_tokens == len(batch.sample_ids) == batch.sample_indices.shape[0]
            and batch.lora is None
            and not batch.prompt_rows
            and meta.max_decode_seq_len <= self.limit
        )

    def logits(self, batch: PreparedBatch) -> torch.Tensor | None:
        """Every row's logits from a graph's replay, or None: run this step eagerly."""
        if not self.fits(batch):
            return None
        n, meta = batch.num_tokens, batch.meta
        size = self.buckets[bisect.bisect_left(self.buckets, n)]
        bound = context_bound(meta.max_decode_seq_len, self.limit)
        key = (size, bound)
        if key not in self.graphs and not self._capture(size, bound):
            return None
        self._fill(batch, size)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]

    def _fill(self, batch: PreparedBatch, size: int) -> None:
        n, meta = batch.num_tokens, batch.meta
        width = meta.decode_block_tables.shape[1]
        self.ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.lens[:n].copy_(meta.decode_seq_lens)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        if size > n:  # padding: no KV written, one token of page 0 read
            self.slots[n:size].fill_(-1)
            self.lens[n:size].fill_(1)
            self.tables[n:size, 0].zero_()

    def _meta(self, size: int, bound: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_seq_lens=self.lens[:size],
            decode_block_tables=self.tables[:size, : bound // self.block_size],
            max_decode_seq_len=bound,
            prefill_query_start_loc=self.start_loc,
            prefill_seq_lens=self.start_loc[:0],
            prefill_block_tables=self.no_prefill,
            prefill_query_lens_list=[],
            prefill_seq_lens_list=[],
        )

    def _capture(self, size: int, bound: int) -> bool:
        """Capture the graph of (``size``, ``bound``); False, for good, if it cannot be."""
        self.slots.fill_(-1)  # the warm-up and capture runs write no KV
        self.lens.fill_(1)
        meta = self._meta(size, bound)

        def step() -> torch.Tensor:
            hidden, _ = self.model(self.ids[:size], self.positions[:size], self.caches, meta)
            return self.model.compute_logits(hidden)

        try:
            self.graphs[size, bound] = self.record(step)
        except Exception:
            logger.warning(
                "decode steps run eagerly: the forward cannot be captured", exc_info=True
            )
            self.broken = True
            return False
        logger.debug("captured the decode graph of batch %d, context %d", size, bound)
        return True

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        """``step`` run once on a side stream (compiling its kernels and settling the
        allocator), then captured into a graph in the shared pool; the graph and its output."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        return graph, out
