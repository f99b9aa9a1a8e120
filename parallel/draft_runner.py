"""The draft model of speculative decoding, run on the rank that owns the engine.

A :class:`DraftRunner` is built only for ``speculative_method: draft``. It holds
the whole draft model (never sharded: with tensor parallelism it runs on the
leader rank alone, in the leader's dtype, on its device) and a paged KV cache
with the target's block count and block size::

    kv_cache: [draft_layers, 2 (K, V), num_blocks, block_size, draft_Hkv, draft_head_dim]

addressed through the target's block tables (see ``engine/draft.py``). It never
sees the target's KV and the target never sees its.

Each :meth:`DraftRunner.propose` runs ``k`` forward passes over the rows it is
given: the first reads every row's unread tokens (prompt chunks and the last
verify's tokens) and guesses one token at the last; each later pass feeds the
rows' previous guesses back, one token per row, greedily.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from pdserve.core.config import EngineConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.distributed.context import SINGLE_RANK
from pdserve.engine.draft import DraftProposer, DraftRow
from pdserve.kernels import select_kernels
from pdserve.kernels.attention import select_backend
from pdserve.kernels.cpu_linear import pack_linears, packing_available
from pdserve.models.builtin import resolve_model
from pdserve.models.families import build_model
from pdserve.models.loader import load_checkpoint
from pdserve.parallel.batch import prepare_batch

logger = logging.getLogger(__name__)

_GREEDY = RowSampling()
# A row of at most this many unread tokens (the last verify's) runs as one decode
# entry per token, as a verifying row does, which is cheaper than a prefill
# chunk; a longer one (a prompt) runs as a prefill chunk.
_DECODE_ROW_TOKENS = 16


def check_vocabulary(target: ModelConfig, draft: ModelConfig) -> None:
    """Refuse a draft model whose token ids mean other tokens than the target's."""
    if draft.vocab_size != target.vocab_size:
        raise InvalidArgumentError(
            "speculative_draft_model",
            f"{draft.path} has a vocabulary of {draft.vocab_size} tokens and the model "
            f"{target.vocab_size}: a draft model must share the model's tokenizer",
        )
    from tokenizers import Tokenizer

    files = [Path(c.path) / "tokenizer.json" for c in (target, draft)]
    if not all(f.is_file() for f in files):
        return  # a checkpoint without a tokenizer: the sizes are all there is to compare
    vocabs = [Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files]
    if vocabs[0] != vocabs[1]:
        raise InvalidArgumentError(
            "speculative_draft_model",
            f"{draft.path} maps tokens to other ids than the model's tokenizer: "
            "a draft model must share the model's tokenizer",
        )


class DraftRunner(DraftProposer):
    """The draft model and its KV cache. Call ``allocate_kv`` before ``propose``."""

    def __init__(
        self, target: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        name = config.speculative.draft_model
        assert name is not None, "built for speculative_method draft only"
        self.model_config = ModelConfig.from_dir(resolve_model(name))
        check_vocabulary(target, self.model_config)
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        backend_cls = select_backend(config.attention_backend, device)
        kernels = select_kernels(config.kernel_backend, device)
        layers = (0, self.model_config.num_layers)
        with torch.device(device):
            self.model = build_model(
                self.model_config, SINGLE_RANK, dtype, layers, backend_cls, kernels
            )
        load_checkpoint(self.model, self.model_config.path, self.model_config.sha256)
        self.model.eval()
        if packing_available(device, dtype):
            pack_linears(self.model)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def for_engine(
        cls, target: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype
    ) -> DraftRunner | None:
        """A draft runner when the engine speculates with a draft model, else None."""
        if config.speculative.method != "draft":
            return None
        return cls(target, config, device, dtype)

    @property
    def max_positions(self) -> int:
        return self.model_config.max_position_embeddings

    def bytes_per_block(self) -> int:
        """Draft KV bytes of one block (all its layers)."""
        m = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    def allocate_kv(self, num_blocks: int) -> None:
        """Zeros, as the target's: masked-out slots still meet V in the attention sum."""
        m = self.model_config
        shape = (m.num_layers, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.caches = [(kv[i, 0], kv[i, 1]) for i in range(m.num_layers)]
        logger.info("draft model %s: %d KV blocks", self.model_config.path, num_blocks)

    @torch.no_grad()
    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        seqs = {r.request_id: _first_seq(r) for r in rows}
        while seqs:
            guesses = self._greedy(list(seqs.values()))
            for i, row in enumerate(rows):
                if row.request_id not in seqs:
                    continue
                out[i].append(guesses[row.request_id])
                seq = seqs.pop(row.request_id)
                if len(out[i]) < row.num_drafts:  # feed the guess back at the next position
                    seqs[row.request_id] = ScheduledSeq(
                        row.request_id, [out[i][-1]], seq.seq_len, row.block_table, _GREEDY
                    )
        return out

    def _greedy(self, seqs: list[ScheduledSeq]) -> dict[str, int]:
        """One forward pass over ``seqs``; the argmax at each one's last token."""
        batch = prepare_batch(StepPlan(0, seqs), self.block_size, self.device)
        hidden, _ = self.model(batch.input_ids, batch.positions, self.caches, batch.meta)
        # A decode-entry row samples at each of its tokens: keep its last.
        ends = list(itertools.accumulate(1 + len(d) for d in batch.sample_drafts))
        last = batch.sample_indices[[e - 1 for e in ends]]
        logits = self.model.compute_logits(hidden[last])  # [S, V]
        tokens = logits.argmax(dim=-1).tolist()
        return dict(zip(batch.sample_ids, tokens, strict=True))


def _first_seq(row: DraftRow) -> ScheduledSeq:
    """A row's unread tokens as one sequence of the draft's first pass."""
    n = len(row.token_ids)
    as_decodes = n - 1 if n <= _DECODE_ROW_TOKENS else 0
    return ScheduledSeq(
        row.request_id, row.token_ids, row.start_pos, row.block_table, _GREEDY, as_decodes
    )
