"""Where ``pdserve.LLM`` runs its requests: one of three backends.

- :class:`LocalBackend`: one rank, the engine core in this process;
- :class:`InstanceBackend`: one instance of several ranks (Ray actors);
- :class:`DisaggregatedBackend`: a prefill instance and a decode instance,
  paired for KV transfer, driven by a :class:`~pdserve.router.pair_client.PairClient`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Protocol

from pdserve.core.config import DisaggregationConfig, EngineConfig
from pdserve.core.model_config import ModelConfig
from pdserve.core.request import RequestOutput
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.engine import EngineCore

Work = tuple[str, str | list[int], SamplingParams]


class Backend(Protocol):
    def generate(
        self, work: list[Work], on_finished: Callable[[RequestOutput], None]
    ) -> list[RequestOutput]: ...

    def check_idle(self) -> None: ...

    def load_lora_adapter(self, name: str, folder: str) -> None: ...

    def unload_lora_adapter(self, name: str) -> None: ...

    def shutdown(self) -> None: ...


class LocalBackend:
    def __init__(
        self, model: ModelConfig, config: EngineConfig, tokenizer: Tokenizer | None
    ) -> None:
        from pdserve.parallel.executor import LocalExecutor

        self.engine = EngineCore(config, model, LocalExecutor(model, config), tokenizer)

    def generate(
        self, work: list[Work], on_finished: Callable[[RequestOutput], None]
    ) -> list[RequestOutput]:
        return self.engine.generate(work, on_finished=on_finished)

    def check_idle(self) -> None:
        self.engine.assert_idle()

    def load_lora_adapter(self, name: str, folder: str) -> None:
        self.engine.load_adapter(name, folder)

    def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def shutdown(self) -> None:
        self.engine.shutdown()


class InstanceBackend:
    def __init__(self, model: ModelConfig, config: EngineConfig, resources: Any) -> None:
        from pdserve.parallel.instance import RankGroup

        self.instance = RankGroup.start(model, config, resources)

    def generate(
        self, work: list[Work], on_finished: Callable[[RequestOutput], None]
    ) -> list[RequestOutput]:
        from pdserve.parallel.rank_spec import GenerateItem

        outputs = list(self.instance.generate([GenerateItem(*w) for w in work]))
        for out in outputs:
            on_finished(out)
        return outputs

    def check_idle(self) -> None:
        self.instance.check_idle()

    def load_lora_adapter(self, name: str, folder: str) -> None:
        self.instance.load_lora_adapter(name, folder)

    def unload_lora_adapter(self, name: str) -> None:
        self.instance.unload_lora_adapter(name)

    def shutdown(self) -> None:
        self.instance.shutdown()


class DisaggregatedBackend:
    def __init__(
        self,
        model: ModelConfig,
        prefill: EngineConfig,
        decode: EngineConfig,
        tokenizer: Tokenizer | None,
        connector: str,
        resources: Any,
        disaggregation: DisaggregationConfig,
    ) -> None:
        from pdserve.cluster.instances import pair, start_instance
        from pdserve.core.layout import plan_layout
        from pdserve.parallel.instance import ensure_ray, rank_needs
        from pdserve.router.pair_client import PairClient

        self.tokenizer = tokenizer
        roles: list[tuple[Literal["prefill", "decode"], EngineConfig]] = [
            ("prefill", prefill),
            ("decode", decode),
        ]
        # One Ray instance sized for both roles' ranks, started before they start at once.
        needs = [rank_needs(plan_layout(model, e.parallel).world_size, resources) for _, e in roles]
        ensure_ray({k: sum(n.get(k, 0.0) for n in needs) for k in ("CPU", "GPU")}, "prefill")
        with ThreadPoolExecutor(2, thread_name_prefix="start") as pool:  # both load at once
            starts = [
                pool.submit(
                    start_instance, role, model, engine, connector, resources, disaggregation
                )
                for role, engine in roles
            ]
        errors = [e for e in (f.exception() for f in starts) if e is not None]
        if errors:
            for f in starts:
                if f.exception() is None:
                    f.result().shutdown()
            raise errors[0]
        self.prefill, self.decode = (f.result() for f in starts)
        try:
            pair(self.prefill, self.decode)
        except BaseException:
            self.shutdown()
            raise
        self.client = PairClient(
            self.prefill.leader,
            self.prefill.instance_id,
            self.decode.leader,
            tokenizer,
            disaggregation.reservation_ttl_s,
        )

    def generate(
        self, work: list[Work], on_finished: Callable[[RequestOutput], None]
    ) -> list[RequestOutput]:
        token_work = [(rid, self._tokens(prompt), p) for rid, prompt, p in work]
        outputs = self.client.generate(token_work)
        for out, (_, prompt, _) in zip(outputs, work, strict=True):
            out.prompt = prompt if isinstance(prompt, str) else None
            on_finished(out)
        return outputs

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        from pdserve.core.errors import InvalidArgumentError

        if self.tokenizer is None:
            raise InvalidArgumentError("prompt", "this model has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    def check_idle(self) -> None:
        import ray

        ray.get([self.prefill.leader.check_idle.remote(), self.decode.leader.check_idle.remote()])

    def load_lora_adapter(self, name: str, folder: str) -> None:
        """On both roles: a request's KV is computed and extended under the same adapter."""
        self.prefill.group.load_lora_adapter(name, folder)
        try:
            self.decode.group.load_lora_adapter(name, folder)
        except BaseException:
            self.prefill.group.unload_lora_adapter(name)
            raise

    def unload_lora_adapter(self, name: str) -> None:
        self.decode.group.unload_lora_adapter(name)
        self.prefill.group.unload_lora_adapter(name)

    def shutdown(self) -> None:
        for instance in (getattr(self, "prefill", None), getattr(self, "decode", None)):
            if instance is not None:
                instance.shutdown()
