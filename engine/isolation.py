"""Running a step plan so that one request's error fails that request, not the batch."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.core.errors import InstanceFailedError
from pdserve.core.step import StepPlan, StepResult, TierWrite, TokenLogprobs
from pdserve.engine.executor import Executor

logger = logging.getLogger(__name__)


def execute_isolating(
    executor: Executor,
    plan: StepPlan,
    forget_writes: Callable[[list[TierWrite]], None] | None,
) -> tuple[StepResult, list[str]]:
    """Run a plan; if it raises, find the requests it raised for.

    A lost rank (:class:`InstanceFailedError`) stops the engine. Any other
    error is a request's, not the instance's: the plan is run again one
    request at a time (recomputing a position writes the same KV), and only
    the requests whose own run raises fail. Returns the merged result and
    the ids of the failed requests.
    """
    try:
        return executor.execute(plan), []
    except InstanceFailedError:
        raise
    except Exception:
        logger.exception("step %d of %d requests failed; isolating", plan.step_id, len(plan.seqs))
    if forget_writes is not None:  # what the failed step wrote down is suspect
        forget_writes(plan.tier_ops.writes)
    sampled: dict[str, int] = {}
    extra: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt: dict[str, list[TokenLogprobs]] = {}
    failed: list[str] = []
    transfer_ok = True
    for i, seq in enumerate(plan.seqs):
        rid = seq.request_id
        alone = StepPlan(
            plan.step_id,
            [seq],
            plan.finished_request_ids if i == 0 else [],
            [k for k in plan.kv_sends if k.request_id == rid],
            [a for a in plan.kv_arrivals if a.request_id == rid],
        )
        try:
            result = executor.execute(alone)
        except InstanceFailedError:
            raise
        except Exception:
            logger.exception("request %r failed in step %d", rid, plan.step_id)
            failed.append(rid)
            continue
        sampled.update(result.sampled)
        extra.update(result.extra)
        logprobs.update(result.logprobs)
        prompt.update(result.prompt_logprobs)
        transfer_ok = transfer_ok and result.kv_transfer_ok
    return StepResult(plan.step_id, sampled, transfer_ok, [], extra, logprobs, prompt), failed
