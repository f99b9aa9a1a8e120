"""Turn a :class:`~pdserve.core.step.StepPlan` into the tensors of one forward pass.

Sequences with one new token (decodes, and one-token prompts) go first so the
attention backend can treat them as one batch; prompt chunks follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.parallel.attention.backend import AttentionMetadata


@dataclass
class PreparedBatch:
    """Model inputs of one step.

    input_ids, positions: [T] int64. sample_indices: [S] int64, the row of each
    sampling sequence's last token in the flat batch; sample_ids and
    sample_rows give its request id and sampling settings, in the same order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    sample_ids: list[str]
    sample_rows: list[RowSampling]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _block_tables(seqs: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
    """[N, max_blocks] int32 block tables, padded with block 0."""
    width = max((len(s.block_table) for s in seqs), default=0)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seqs), width)


def prepare_batch(plan: StepPlan, block_size: int, device: torch.device) -> PreparedBatch:
    decodes = [s for s in plan.seqs if s.num_tokens == 1]
    prefills = [s for s in plan.seqs if s.num_tokens > 1]
    ordered = decodes + prefills
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_indices: list[int] = []
    sample_ids: list[str] = []
    sample_rows: list[RowSampling] = []
    for seq in ordered:
        table = seq.block_table
        for pos in range(seq.start_pos, seq.seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        positions.extend(range(seq.start_pos, seq.seq_len))
        input_ids.extend(seq.token_ids)
        if seq.sampling is not None:
            sample_indices.append(len(input_ids) - 1)
            sample_ids.append(seq.request_id)
            sample_rows.append(seq.sampling)

    def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    query_lens = [s.num_tokens for s in prefills]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=ints(slots, torch.int64),
        num_decode_tokens=len(decodes),
        decode_seq_lens=ints([s.seq_len for s in decodes]),
        decode_block_tables=_block_tables(decodes, device),
        max_decode_seq_len=max((s.seq_len for s in decodes), default=0),
        prefill_query_start_loc=ints(starts),
        prefill_seq_lens=ints([s.seq_len for s in prefills]),
        prefill_block_tables=_block_tables(prefills, device),
        prefill_query_lens_list=query_lens,
        prefill_seq_lens_list=[s.seq_len for s in prefills],
    )
    return PreparedBatch(
        input_ids=ints(input_ids, torch.int64),
        positions=ints(positions, torch.int64),
        meta=meta,
        sample_indices=ints(sample_indices, torch.int64),
        sample_ids=sample_ids,
        sample_rows=sample_rows,
    )
