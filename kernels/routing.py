"""Top-k routing of mixture-of-experts tokens, one pass over the router logits.

Same contract as :func:`pdserve.kernels.reference.route`: softmax over the experts in
float32, the ``k`` largest probabilities in descending order, renormalised to
sum to one. Ties go to the lower expert id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.support import next_pow2, rows_per_program


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    num_rows,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_mask = rows < num_rows
    cols = tl.arange(0, BLOCK_E)
    col_mask = (cols < num_experts)[None, :]
    mask = row_mask[:, None] & col_mask
    logits = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=mask, other=0.0)
    logits = tl.where(col_mask, logits.to(tl.float32), float("-inf"))
    e = tl.exp(logits - tl.max(logits, 1)[:, None])  # exp(-inf) = 0 past the experts
    probs = e / tl.sum(e, 1)[:, None]
    probs = tl.where(col_mask, probs, -1.0)  # padding is never chosen
    slots = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros([ROWS, BLOCK_K], tl.float32)
    experts = tl.zeros([ROWS, BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, 1)
        choice = tl.argmax(probs, 1, tie_break_left=True)
        weights = tl.where(slots == i, best[:, None], weights)
        experts = tl.where(slots == i, choice[:, None], experts)
        probs = tl.where(cols[None, :] == choice[:, None], -1.0, probs)
    weights = tl.where(slots < TOP_K, weights, 0.0)
    weights = weights / tl.sum(weights, 1)[:, None]
    out_mask = row_mask[:, None] & (slots < TOP_K)
    dst = rows[:, None] * TOP_K + slots
    tl.store(weights_ptr + dst, weights, mask=out_mask)
    tl.store(experts_ptr + dst, experts.to(tl.int64), mask=out_mask)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> ([T, k] float32 weights summing to 1, [T, k] int64 expert ids)."""
    num_rows, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    device = logits.device
    weights = torch.empty((num_rows, top_k), dtype=torch.float32, device=device)
    experts = torch.empty((num_rows, top_k), dtype=torch.int64, device=device)
    if num_rows:
        block_e = next_pow2(num_experts)
        rows = rows_per_program(block_e, num_rows)
        _route_kernel[(triton.cdiv(num_rows, rows),)](
            logits,
            weights,
            experts,
            num_rows,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            ROWS=rows,
            BLOCK_E=block_e,
            BLOCK_K=next_pow2(top_k),
        )
    return weights, experts
