"""Turn a :class:`~pdserve.core.step.StepPlan` into the tensors of one forward pass.

Sequences with one new token (decodes, and one-token prompts) go first so the
attention backend can treat them as one batch; prompt chunks follow. A row that
verifies drafts (its last token and the drafts) joins the decodes as one decode
entry per token, each seeing the context up to its own position: every backend
writes the step's K/V before it attends, so that is the row's causal attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.kernels.attention.backend import AttentionMetadata
from pdserve.models.lora import LoRABatch, adapter_indices


@dataclass
class PreparedBatch:
    """Model inputs of one step.

    input_ids, positions: [T] int64. sample_indices: [sum(sample_counts)] int64,
    the rows of the flat batch whose logits are sampled: each sampling
    sequence's last token, or for a row with ``k`` drafts its last ``k + 1``
    tokens. sample_ids, sample_rows and sample_drafts give each sampling
    sequence's request id, settings and drafts (empty for none), in the same order.
    lora: which rows run under which LoRA adapter (None: every row on the base model).
    prompt_rows: per chunk asking for prompt logprobs, its request id, the row of its
    first token in the flat batch, its targets and how many top tokens it wants.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    sample_ids: list[str]
    sample_rows: list[RowSampling]
    sample_drafts: list[list[int]]
    lora: LoRABatch | None = None
    prompt_rows: list[tuple[str, int, Sequence[int], int]] = field(default_factory=list)

    @property
    def max_sample_tokens(self) -> int:
        """Most tokens one sampling row can yield this step."""
        return 1 + max((len(d) for d in self.sample_drafts), default=0)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _padded(tables: list[list[int]]) -> tuple[list[int], int]:
    """Block tables as one flat row-major list, padded with block 0, and its width."""
    width = max((len(t) for t in tables), default=0)
    return [b for t in tables for b in (*t, *[0] * (width - len(t)))], width


def _tensors(
    groups: list[list[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One 1-D tensor per list: views of one buffer, built with one copy to ``device``."""
    whole = torch.tensor([v for g in groups for v in g], dtype=dtype, device=device)
    return list(whole.split_with_sizes([len(g) for g in groups]))


def _decode_entries(decodes: list[ScheduledSeq]) -> tuple[list[int], list[list[int]]]:
    """Context length and block table of each decode token (several per verifying row)."""
    lens = [n for s in decodes for n in range(s.start_pos + 1, s.seq_len + 1)]
    return lens, [s.block_table for s in decodes for _ in range(s.num_tokens)]


def _lora_rows(
    ordered: list[ScheduledSeq], adapters: Sequence[str | None], device: torch.device
) -> LoRABatch | None:
    """Each token row's adapter (``adapters``: the served names, by slot; None: free)."""
    if not any(s.lora is not None for s in ordered):
        return None
    per_seq = adapter_indices([s.lora for s in ordered], adapters)
    rows = [i for s, i in zip(ordered, per_seq, strict=True) for _ in range(s.num_tokens)]
    return LoRABatch.build(rows, device)


def _layout(
    decodes: list[ScheduledSeq],
    prefills: list[ScheduledSeq],
    slot_mapping: torch.Tensor,
    device: torch.device,
) -> AttentionMetadata:
    """The attention metadata of decodes then prefill chunks (int32 tensors, one copy)."""
    query_lens = [s.num_tokens for s in prefills]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode_lens, decode_tables = _decode_entries(decodes)
    decode_flat, decode_width = _padded(decode_tables)
    prefill_flat, prefill_width = _padded([s.block_table for s in prefills])
    lens, tables, start_loc, prefill_lens, prefill_tables = _tensors(
        [decode_lens, decode_flat, starts, [s.seq_len for s in prefills], prefill_flat],
        torch.int32,
        device,
    )
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=len(decode_lens),
        decode_seq_lens=lens,
        decode_block_tables=tables.view(len(decode_tables), decode_width),
        max_decode_seq_len=max(decode_lens, default=0),
        prefill_query_start_loc=start_loc,
        prefill_seq_lens=prefill_lens,
        prefill_block_tables=prefill_tables.view(len(prefills), prefill_width),
        prefill_query_lens_list=query_lens,
        prefill_seq_lens_list=[s.seq_len for s in prefills],
    )


def prepare_batch(
    plan: StepPlan, block_size: int, device: torch.device, adapters: Sequence[str | None] = ()
) -> PreparedBatch:
    decodes = [s for s in plan.seqs if s.num_tokens == 1 or s.num_draft_tokens]
    prefills = [s for s in plan.seqs if s.num_tokens > 1 and not s.num_draft_tokens]
    ordered = decodes + prefills
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_indices: list[int] = []
    prompt_rows: list[tuple[str, int, Sequence[int], int]] = []
    for seq in ordered:
        if seq.prompt_targets:
            prompt_rows.append(
                (seq.request_id, len(input_ids), seq.prompt_targets, seq.prompt_logprobs)
            )
        table = seq.block_table
        for pos in range(seq.start_pos, seq.seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        positions.extend(range(seq.start_pos, seq.seq_len))
        input_ids.extend(seq.token_ids)
        if seq.sampling is not None:  # the last known token's row, then each draft's
            sample_indices.extend(range(len(input_ids) - 1 - seq.num_draft_tokens, len(input_ids)))
    sampled = [s for s in ordered if s.sampling is not None]

    # Two host-to-device copies per step: the int64 inputs here, the int32 layout in _layout.
    ids_t, positions_t, slot_mapping, samples_t = _tensors(
        [input_ids, positions, slots, sample_indices], torch.int64, device
    )
    meta = _layout(decodes, prefills, slot_mapping, device)
    return PreparedBatch(
        input_ids=ids_t,
        positions=positions_t,
        meta=meta,
        sample_indices=samples_t,
        sample_ids=[s.request_id for s in sampled],
        sample_rows=[s.sampling for s in sampled if s.sampling is not None],
        sample_drafts=[s.token_ids[s.num_tokens - s.num_draft_tokens :] for s in sampled],
        lora=_lora_rows(ordered, adapters, device),
        prompt_rows=prompt_rows,
    )
