"""``pdserve.LLM``: offline batch generation on one engine.

llm = pdserve.LLM(model="builtin:tiny")
outputs = llm.generate(["Hello", "The router"], pdserve.SamplingParams(max_tokens=16))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Any, cast

from tqdm import tqdm

from pdserve.core.builtin_models import resolve_model
from pdserve.core.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.core.engine import EngineCore
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.request import RequestOutput
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer

Prompt = str | list[int]


def build_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """An :class:`EngineConfig` from flat keyword arguments (the API's and the CLI's)."""
    groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "parallel": {}}
    fields = {
        "cache": CacheConfig.__dataclass_fields__,
        "scheduler": SchedulerConfig.__dataclass_fields__,
        "parallel": ParallelConfig.__dataclass_fields__,
    }
    top: dict[str, Any] = {}
    for name, value in kwargs.items():
        group = next((g for g, names in fields.items() if name in names), None)
        if group is not None:
            groups[group][name] = value
        elif name in EngineConfig.__dataclass_fields__:
            top[name] = value
        else:
            raise InvalidArgumentError(name, "unknown engine option")
    return EngineConfig(
        model=model,
        cache=CacheConfig(**groups["cache"]),
        scheduler=SchedulerConfig(**groups["scheduler"]),
        parallel=ParallelConfig(**groups["parallel"]),
        **top,
    )


class LLM:
    """A model loaded on this machine, generating for batches of prompts.

    Keyword arguments are the fields of :class:`~pdserve.core.config.EngineConfig`
    and its parts, e.g. ``dtype``, ``max_model_len``, ``block_size``,
    ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = build_engine_config(model, **kwargs)
        path = resolve_model(model)
        self.model_config = ModelConfig.from_dir(path)
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        self.engine = EngineCore(self.config, self.model_config, self._executor(), tokenizer)
        self._ids = itertools.count()

    def _executor(self) -> Any:
        if self.config.parallel.world_size > 1 or self.config.parallel.expert_parallel_size > 1:
            raise InvalidArgumentError(
                "tensor_parallel_size", "multi-rank layouts are not available in this build"
            )
        from pdserve.parallel.executor import LocalExecutor

        return LocalExecutor(self.model_config, self.config)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        batch = _as_batch(prompts)
        if sampling_params is None:
            params: Sequence[SamplingParams] = [SamplingParams()] * len(batch)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise InvalidArgumentError(
                    "sampling_params", f"{len(params)} given for {len(batch)} prompts"
                )
        ids = [f"offline-{next(self._ids)}" for _ in batch]
        try:
            for rid, prompt, p in zip(ids, batch, params, strict=True):
                self.engine.add_request(rid, prompt, p)
            return self._run(ids, use_tqdm)
        finally:
            for rid in ids:  # nothing is left behind if a prompt was refused or a step failed
                self.engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    for i, p in enumerate(items):
        if not isinstance(p, str | list):
            raise InvalidArgumentError(
                f"prompts[{i}]", f"must be a string or a list of token ids, got {type(p).__name__}"
            )
    if not items:
        raise InvalidArgumentError("prompts", "must not be empty")
    return cast(list[Prompt], items)
