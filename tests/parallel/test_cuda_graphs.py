"""The decode graphs' bookkeeping on the CPU: static inputs, padding to buckets, which
steps qualify. The capture itself needs CUDA (tests/parallel/test_cuda.py); here a
"graph" reruns the captured function on the same static tensors when replayed, so the
engine's tokens through :class:`DecodeGraphs` must equal its eager tokens. The
Triton kernels run in the interpreter: their handling of padding rows (slot -1) is
the GPU's.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve import LLM, SamplingParams
from pdserve.parallel.cuda_graphs import DecodeGraphs
from tests.kernels.triton_check import triton_problem

_PROBLEM = triton_problem(torch.device("cpu"))
if _PROBLEM is not None or torch.cuda.is_available():
    pytest.skip(_PROBLEM or "the real graphs run on CUDA", allow_module_level=True)


class Rerun:
    """A stand-in for a CUDA graph: replay runs the step again into the same output."""

    def __init__(self, step: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.step, self.out = step, out

    def replay(self) -> None:
        self.out.copy_(self.step())


class RerunGraphs(DecodeGraphs):
    def record(self, step: Callable[[], torch.Tensor]) -> tuple[Rerun, torch.Tensor]:
        out = step()
        return Rerun(step, out), out


def engine(folder: str, graphs: bool) -> LLM:
    llm = LLM(
        folder,
        device="cpu",
        dtype="float32",
        kernel_backend="triton",
        attention_backend="triton",
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    if graphs:
        r = llm.engine.executor.runner  # type: ignore[attr-defined]
        limit = r.num_blocks * r.block_size
        r.graphs = RerunGraphs(r.model, r.caches, 8, limit, r.block_size, r.device)
    return llm


def test_padded_decode_steps_give_the_eager_tokens(references) -> None:
    folder, prompts, reference = references("llama")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [r[:6] for r in reference[:5]]
    llm = engine(str(folder), graphs=True)
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    for n in (1, 3, 5):  # buckets 1, 4 (one padding row) and 8 (three)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], greedy)]
        assert got == want[:n]
    assert {size for size, _ in graphs.graphs} >= {1, 4, 8}
    assert not graphs.broken
    llm.check_idle()


def test_steps_that_do_not_qualify_run_eagerly(references) -> None:
    """Prompt chunks, prompt logprobs and drafts take the eager path; tokens still match."""
    folder, prompts, reference = references("llama")
    llm = engine(str(folder), graphs=True)
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate(prompts[:2], params)
    assert [o.outputs[0].token_ids for o in out] == [r[:4] for r in reference[:2]]
    assert all(o.prompt_logprobs for o in out)
    assert graphs.graphs  # the decode steps after the prompts were replayed
    llm.check_idle()
