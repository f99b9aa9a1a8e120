"""``pdserve.LLM``: offline batch generation on one engine.

llm = pdserve.LLM(model="builtin:tiny")
outputs = llm.generate(["Hello", "The router"], pdserve.SamplingParams(max_tokens=16))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from types import TracebackType
from typing import Any, cast

from tqdm import tqdm

from pdserve.backends import (
    Backend,
    DisaggregatedBackend,
    InstanceBackend,
    LocalBackend,
)
from pdserve.core.config import DisaggregationConfig, build_engine_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.model_config import ModelConfig
from pdserve.core.request import RequestOutput
from pdserve.core.sampling_params import SamplingParams, check_text
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.engine import EngineCore
from pdserve.models.builtin import resolve_model

Prompt = str | list[int]


class LLM:
    """A model on this machine (one rank) or on Ray actors (several ranks, or disaggregated).

    Keyword arguments are the fields of :class:`~pdserve.core.config.EngineConfig`
    and its parts, e.g. ``dtype``, ``max_model_len``, ``block_size``,
    ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``tensor_parallel_size``, ``pipeline_parallel_size``, ``expert_parallel_size``,
    ``lora_adapters`` (``{name: PEFT folder}``; a request picks one with
    ``SamplingParams(lora=name)``), ``max_lora_rank`` and ``max_loras``; adapters
    load and unload at runtime too (:meth:`load_lora_adapter`).
    A layout of more than one rank runs as an instance of Ray actors (on the Ray
    cluster found, or a local one); ``num_cpus_per_rank`` and
    ``num_gpus_per_rank`` size each rank.

    ``disaggregated=True`` runs a prefill instance and a decode instance paired
    for KV transfer: ``prefill`` and ``decode`` are dicts of per-role options
    (layouts, scheduler, cache) over the shared ones; ``connector`` picks the
    transfer ("auto": "cuda_ipc" on GPUs, "shm" on the CPU; or "object_store", "p2p",
    "nccl");
    ``disaggregation`` sets when the decode instance prefills a request itself.
    """

    def __init__(
        self,
        model: str,
        *,
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float | None = None,
        disaggregated: bool = False,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        connector: str = "auto",
        disaggregation: DisaggregationConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = build_engine_config(model, **kwargs)
        path = resolve_model(model)
        self.model_config = ModelConfig.from_dir(path)
        self._tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        self._ids = itertools.count()
        self.backend: Backend
        if disaggregated:
            from pdserve.parallel.instance import RankResources

            gpus = self._gpus(num_gpus_per_rank)
            self.backend = DisaggregatedBackend(
                self.model_config,
                build_engine_config(model, **{**kwargs, **(prefill or {})}),
                build_engine_config(model, **{**kwargs, **(decode or {})}),
                self._tokenizer,
                connector,
                RankResources(num_cpus=num_cpus_per_rank, num_gpus=gpus),
                disaggregation or DisaggregationConfig(),
            )
        elif self.config.parallel.world_size > 1 or self.config.parallel.expert_parallel_size > 1:
            from pdserve.parallel.instance import RankResources

            gpus = self._gpus(num_gpus_per_rank)
            resources = RankResources(num_cpus=num_cpus_per_rank, num_gpus=gpus)
            self.backend = InstanceBackend(self.model_config, self.config, resources)
        else:
            self.backend = LocalBackend(self.model_config, self.config, self._tokenizer)

    def _gpus(self, requested: float | None) -> float:
        if requested is not None:
            return requested
        from pdserve.parallel.model_runner import resolve_device

        return 1.0 if resolve_device(self.config.device).type == "cuda" else 0.0

    @property
    def engine(self) -> EngineCore:
        """The in-process engine core (one-rank backend only)."""
        if not isinstance(self.backend, LocalBackend):
            raise AttributeError("this LLM runs on Ray actors; there is no in-process engine")
        return self.backend.engine

    @property
    def instance(self) -> Any:
        return self.backend.instance if isinstance(self.backend, InstanceBackend) else None

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def check_idle(self) -> None:
        """Raise AssertionError unless every request ended and every KV block is free."""
        self.backend.check_idle()

    def load_lora_adapter(self, name: str, folder: str | os.PathLike[str]) -> None:
        """Serve the PEFT LoRA adapter in ``folder`` as ``name`` from now on, on every rank.

        Checked as at start-up (InvalidArgumentError naming the field); refused
        (AdapterConflictError, 409) when ``name`` is taken or ``max_loras`` are held.
        """
        self.backend.load_lora_adapter(name, os.fspath(folder))

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``: UnknownAdapterError (404) if not held,
        AdapterConflictError (409, naming how many) while requests use it."""
        self.backend.unload_lora_adapter(name)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        batch = _as_batch(prompts)
        params = _as_params(sampling_params, len(batch))
        work = [
            (f"offline-{next(self._ids)}", prompt, p)
            for prompt, p in zip(batch, params, strict=True)
        ]
        with tqdm(total=len(work), disable=not use_tqdm, desc="generate") as bar:
            return self.backend.generate(work, lambda _: _tick(bar))

    def shutdown(self) -> None:
        self.backend.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def _tick(bar: tqdm) -> None:
    bar.update(1)


def _as_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> Sequence[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, str) or not isinstance(sampling_params, Sequence):
        raise InvalidArgumentError(
            "sampling_params",
            f"must be a SamplingParams or a list of them, got {type(sampling_params).__name__}",
        )
    for i, one in enumerate(sampling_params):
        if not isinstance(one, SamplingParams):
            raise InvalidArgumentError(
                f"sampling_params[{i}]", f"must be a SamplingParams, got {type(one).__name__}"
            )
    if len(sampling_params) != n:
        raise InvalidArgumentError(
            "sampling_params", f"{len(sampling_params)} given for {n} prompts"
        )
    return sampling_params


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        check_text("prompts", prompts)
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise InvalidArgumentError(
            "prompts",
            f"must be a string, a list of token ids or a list of those, got {type(prompts).__name__}",
        )
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    for i, p in enumerate(items):
        if not isinstance(p, str | list):
            raise InvalidArgumentError(
                f"prompts[{i}]", f"must be a string or a list of token ids, got {type(p).__name__}"
            )
        if isinstance(p, str):
            check_text(f"prompts[{i}]", p)
    if not items:
        raise InvalidArgumentError("prompts", "must not be empty")
    return cast(list[Prompt], items)
