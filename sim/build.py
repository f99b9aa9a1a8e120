"""From a cluster YAML and profiles to simulated instances.

:class:`ProfileBook` answers "which latency model times an instance of this
layout": a profile file whose model and layout match, else (with a device) an
analytic profile of that layout, else an error naming the layout to profile.
:func:`make_instance` builds one :class:`~pdserve.sim.instance.SimInstance`
of a region and role exactly as the cluster YAML configures the live one
(scheduler options, block size, prefix caching, KV blocks; the KV pool is the
config's ``num_blocks`` or, as on a GPU, what the profile's memory holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cluster.config import ClusterConfig, RegionConfig
from pdserve.core.errors import InvalidArgumentError
from pdserve.engine.kv_cache_manager import resolve_max_model_len
from pdserve.sim.analytic import Assumptions, analytic_profile, model_shape
from pdserve.sim.instance import SimInstance
from pdserve.sim.profile import ModelShape, Profile


@dataclass
class ProfileBook:
    """Profiles by layout for one model: files first, then analytic ones for ``device``."""

    model: ModelShape
    profiles: list[Profile] = field(default_factory=list)
    device: str | None = None
    assumptions: Assumptions = field(default_factory=Assumptions)
    _cache: dict[tuple[int, int], Profile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.profiles):  # every file must describe this model
            p.check_matches(
                self.model, p.tensor_parallel_size, p.pipeline_parallel_size, f"profile[{i}]"
            )

    def get(self, tp: int, pp: int) -> Profile:
        key = (tp, pp)
        if key not in self._cache:
            found = [
                p
                for p in self.profiles
                if (p.tensor_parallel_size, p.pipeline_parallel_size) == key
            ]
            if found:
                self._cache[key] = found[0]
            elif self.device is not None:
                self._cache[key] = analytic_profile(
                    self.model, self.device, tp, pp, self.assumptions
                )
            else:
                have = sorted(
                    (p.tensor_parallel_size, p.pipeline_parallel_size) for p in self.profiles
                )
                raise InvalidArgumentError(
                    "profile",
                    f"no profile for layout tp={tp} pp={pp} (have tp,pp {have}); "
                    "profile that layout or pass --device for an analytic one",
                )
        return self._cache[key]


def book_for(
    config: ClusterConfig,
    profiles: list[Profile],
    device: str | None,
    assumptions: Assumptions | None = None,
) -> ProfileBook:
    """The profile book of the config's model (its shape from a preset, the checkpoint,
    or, for a model not on this machine, the profiles themselves)."""
    try:
        shape = model_shape(config.model)
    except InvalidArgumentError:
        named = [p.model for p in profiles if p.model.name == config.model]
        if not named:
            raise InvalidArgumentError(
                "model",
                f"{config.model!r} is neither a preset, a loadable model nor the model of a "
                "given profile",
            ) from None
        shape = named[0]
    return ProfileBook(shape, list(profiles), device, assumptions or Assumptions())


def layout(config: ClusterConfig, region: RegionConfig, role: str) -> tuple[int, int]:
    par = config.engine_config(role, region).parallel
    return par.tensor_parallel_size, par.pipeline_parallel_size


def make_instance(
    config: ClusterConfig,
    book: ProfileBook,
    region: RegionConfig,
    role: str,
    instance_id: str,
    clock: Callable[[], float] | None = None,
) -> tuple[SimInstance, Profile]:
    engine = config.engine_config(role, region)
    tp, pp = layout(config, region, role)
    profile = book.get(tp, pp)
    bs = engine.cache.block_size
    num_blocks = engine.cache.num_blocks or max(1, profile.kv_capacity_tokens // bs)
    max_len = resolve_max_model_len(engine, book.model.max_position_embeddings, num_blocks)
    step = profile.role_steps.get(role, profile.step)  # a calibrated role's, else the profile's
    inst = SimInstance(
        instance_id,
        role,
        region.name,
        step,
        engine.scheduler,
        num_blocks,
        bs,
        max_len,
        engine.cache.enable_prefix_caching,
        clock,
    )
    inst.threads = tp * pp * max(1, int(region.role(role).num_cpus_per_rank))  # as a rank sets
    return inst, profile
