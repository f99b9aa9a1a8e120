"""The router's view of the cluster: every instance, its load, its prefix cache.

Load has two sources. Instances push a :class:`~pdserve.core.messages.LoadReport`
every ~100 ms (queue, batch, free pages, recent step time, KV events). The
router adds what it knows sooner: requests it placed and whose stream has not
ended (``inflight``), and prompt tokens it sent that have not produced a first
token yet (``pending_prompt_tokens``). Policies read both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.core.messages import LoadReport

# Per-token prefill time and per-step decode time assumed before any report.
PRIOR_PREFILL_S_PER_TOKEN = 2e-4
PRIOR_DECODE_STEP_S = 0.02


@dataclass
class InstanceView:
    instance_id: str
    role: str  # "prefill" or "decode"
    region: str
    handle: Any
    block_size: int
    max_model_len: int
    paired: set[str] = field(default_factory=set)  # prefill: decode ids it can send to
    model: str = ""  # the deployment key of the model version it serves (pdserve.router.models)
    report: LoadReport | None = None
    inflight: int = 0
    pending_prompt_tokens: int = 0
    draining: bool = False
    # LoRA adapters it holds now: name -> content fingerprint (router/lora_admin.py).
    adapters: dict[str, str] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.report is None or self.report.healthy

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    @property
    def prefill_s_per_token(self) -> float:
        r = self.report
        if r is None or r.step_tokens < 1 or r.step_seconds <= 0:
            return PRIOR_PREFILL_S_PER_TOKEN
        return r.step_seconds / r.step_tokens

    @property
    def queued_prompt_tokens(self) -> int:
        reported = self.report.waiting_prompt_tokens if self.report else 0
        return max(reported, self.pending_prompt_tokens)

    @property
    def free_fraction(self) -> float:
        r = self.report
        return 1.0 if r is None or r.num_blocks == 0 else r.free_blocks / r.num_blocks

    @property
    def decode_step_s(self) -> float:
        """Its recent mean step time; NaN while it has run no step (see RegionTable)."""
        r = self.report
        return float("nan") if r is None or r.step_seconds <= 0 else r.step_seconds


class RegionTable:
    """The available instances of one role in one region, their numbers as arrays.

    Policies score every instance with a few vector operations, so a decision
    stays cheap with a thousand instances. Rows are refreshed whenever an
    instance reports or the router changes its in-flight counts.
    """

    def __init__(self, views: list[InstanceView]) -> None:
        self.views = views
        self.index = {v.instance_id: i for i, v in enumerate(views)}
        n = len(views)
        self.queued = np.zeros(n)
        self.per_token = np.zeros(n)
        self.inflight = np.zeros(n)
        self.running = np.zeros(n)
        self.step = np.zeros(n)
        self.free_blocks = np.zeros(n)
        self.block_tokens = views[0].block_size if views else 16
        for i in range(n):
            self.refresh(i)

    def __len__(self) -> int:
        return len(self.views)

    def refresh(self, i: int) -> None:
        v = self.views[i]
        r = v.report
        self.queued[i] = v.queued_prompt_tokens
        self.per_token[i] = v.prefill_s_per_token
        self.inflight[i] = v.inflight
        self.running[i] = r.running if r else 0
        self.step[i] = v.decode_step_s
        self.free_blocks[i] = r.free_blocks if r else 1e9

    def decode_tpot(self) -> np.ndarray:
        """Estimated time per output token of one more request at each instance.

        An instance that has not stepped yet is taken to be as fast as the
        fastest one that has (an idle instance must not look slower than a
        busy one); each request in flight at an instance adds 10%, so a burst
        of arrivals spreads before the instances' next load reports.
        """
        measured = ~np.isnan(self.step)
        fallback = float(self.step[measured].min()) if measured.any() else PRIOR_DECODE_STEP_S
        return np.where(measured, self.step, fallback) * (1.0 + 0.1 * self.inflight)


class ClusterView:
    """Every instance, and per (role, region, model version, LoRA adapter) a table of
    the available ones; an adapter's table holds only instances that hold it with
    the content the cluster serves under its name for that model version
    (``adapter_fingerprints``: names are scoped per model, so two models may each
    serve their own adapter under one name)."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceView] = {}
        # (role, region, model) -> LoRA adapter (None: any) -> its table.
        self._tables: dict[tuple[str, str, str], dict[str | None, RegionTable]] = {}
        self.adapter_fingerprints: dict[tuple[str, str], str] = {}  # (model, name) -> content

    def set_adapter(self, instance_id: str, name: str, fingerprint: str | None) -> None:
        """``instance_id`` now holds adapter ``name`` (None: no longer holds it). The first
        content seen under a name of its model version is the one served; other content
        there is no holder."""
        view = self.instances.get(instance_id)
        if view is None:
            return
        if fingerprint is None:
            view.adapters.pop(name, None)
            if not any(
                name in v.adapters for v in self.instances.values() if v.model == view.model
            ):
                self.adapter_fingerprints.pop((view.model, name), None)
        else:
            view.adapters[name] = fingerprint
            self.adapter_fingerprints.setdefault((view.model, name), fingerprint)
        self._tables.clear()

    def holds(self, view: InstanceView, lora: str | None) -> bool:
        served = self.adapter_fingerprints.get((view.model, lora or ""))
        return lora is None or view.adapters.get(lora, "") == served

    def add(self, view: InstanceView) -> None:
        self.instances[view.instance_id] = view
        self._tables.clear()

    def remove(self, instance_id: str) -> InstanceView | None:
        self._tables.clear()
        return self.instances.pop(instance_id, None)

    def set_available(self, instance_id: str, draining: bool) -> None:
        self.instances[instance_id].draining = draining
        self._tables.clear()

    def table(
        self, role: str, region: str, model: str = "", lora: str | None = None
    ) -> RegionTable:
        """The available instances of ``role`` in ``region`` serving the model version
        whose deployment key is ``model`` (and, with ``lora``, holding that adapter)."""
        tables = self._tables.setdefault((role, region, model), {})
        if lora not in tables:
            views = [
                v
                for v in self.instances.values()
                if v.role == role
                and v.region == region
                and v.model == model
                and v.available
                and self.holds(v, lora)
            ]
            tables[lora] = RegionTable(views)
        return tables[lora]

    def touch(self, view: InstanceView) -> None:
        """Refresh the view's row, in every table of its role, region and model, after its
        load changed."""
        tables = self._tables.get((view.role, view.region, view.model))
        if not tables:
            return
        for lora, table in list(tables.items()):
            if view.instance_id in table.index:
                table.refresh(table.index[view.instance_id])
            if (view.instance_id in table.index) != (view.available and self.holds(view, lora)):
                tables.pop(lora, None)

    def regions(self) -> list[str]:
        return sorted({v.region for v in self.instances.values()})
