"""An instance's latency model and its file (``profile.json``).

One engine step runs a batch of sequences; sequence ``i`` computes ``n_i`` new
tokens on top of ``c_i`` cached ones. A step is summarised by four features
(:class:`StepFeatures`) and its time predicted by :class:`StepModel`::

    compute = s_per_token * sum(n_i) + s_per_attn * sum(n_i * (c_i + (n_i + 1) / 2))
    memory  = weights_s + s_per_ctx * sum(c_i + n_i)
    t       = overhead_s + s_per_seq * len(batch) + (compute + memory)   # combine="sum"
                                                  or max(compute, memory) # combine="max"

A live step can take longer than that (:meth:`StepModel.live_time`): one that
starts after the instance sat idle longer than ``cold_after_s`` takes
``cold_compute * compute + cold_factor * (t - compute)`` more (caches and thread
pools gone cold), and one that runs while another instance on its host is
mid-step takes ``shared_compute * compute + shared_factor * (t - compute)`` more
(the host's other work pushed onto its cores). All four are 0 in a profile,
which times steps back to back on a quiet host; ``pdserve sim-validate`` fits
them from live steps, and with them the noise around the model (``jitter``
and ``jitter_s``: :mod:`pdserve.sim.jitter`).

A prefill step is compute-bound (many new tokens), a decode step memory-bound
(one new token per sequence over its whole context); one model covers both
and every mix the scheduler builds. Fitted models (measured on the real engine)
use ``sum``, which least squares can fit; analytic GPU models use ``max`` (the
roofline). :class:`TransferModel` gives the KV hand-off time per connector.

A :class:`Profile` records what it describes (model shape, layout, device),
how it was made (command, machine, date) and, for a measured one, the samples
and the fit's error; a calibrated one (``pdserve sim-validate --write-profiles``)
also each role's live steps, a request's overhead outside the steps and its
noise, and that its instances shared one host. ``load_profile`` checks
everything and names the bad field.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pdserve.core.errors import InvalidArgumentError
from pdserve.transfer import resolve_connector

COMBINES = ("sum", "max")
SOURCES = ("measured", "analytic")
PHASES = ("prefill", "decode")
DTYPES = ("float32", "bfloat16", "float16")
PROFILE_VERSION = 1
# Bounds on a profile's values: past them a file is refused, not simulated. A time
# (a step's or a hand-off's parts, and one simulated step or hand-off as a whole) is at
# most an hour, so a simulation's virtual time, and the planner's ticks across it, stay
# bounded: a coefficient of 1e30 s once ran the event loop for ever.
MAX_SECONDS = 3600.0
MAX_FACTOR = 100.0  # a cold or shared step's extra time, in times its own
MAX_JITTER = 2.0  # sd of a step's log time (fitted ones are 0.05-0.5)
MAX_COUNT = 1 << 40  # tokens, bytes, features of a sample
MAX_DIM = 1 << 24  # a model's layers, widths, heads, vocabulary, experts
MAX_RANKS = 1 << 12  # tensor or pipeline parallel size


def check_number(
    name: str, value: object, hi: float = MAX_SECONDS, lo: float = 0.0, above: bool = False
) -> None:
    """Raise InvalidArgumentError naming ``name`` unless ``value`` is a finite real in
    ``[lo, hi]`` (``(lo, hi]`` where ``above``); a bool is not a number here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(name, f"must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer past any float: out of range either way
        raise InvalidArgumentError(
            name, f"must be in [{lo:g}, {hi:g}], got {_shown(value)}"
        ) from None
    if not math.isfinite(number):
        raise InvalidArgumentError(name, f"must be finite, got {_shown(value)}")
    if number < lo or (above and number == lo):
        raise InvalidArgumentError(
            name, f"must be {'>' if above else '>='} {lo:g}, got {_shown(value)}"
        )
    if number > hi:
        raise InvalidArgumentError(name, f"must be at most {hi:g}, got {_shown(value)}")


def check_int(name: str, value: object, hi: int, lo: int = 1) -> None:
    """Raise InvalidArgumentError naming ``name`` unless ``value`` is an integer in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(name, f"must be an integer, got {_shown(value)}")
    if not lo <= int(value) <= hi:
        raise InvalidArgumentError(name, f"must be in [{lo}, {hi}], got {_shown(value)}")


def _shown(value: object) -> str:
    """``repr(value)``, cut to a length an error line can carry."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python will print
        return "an integer too long to print"
    return text if len(text) <= 60 else text[:57] + "..."


def _key(name: str) -> str:
    """A key of a file as an error's field names it: quoted unless a plain word."""
    return name if name.isidentifier() and len(name) <= 40 else _shown(name)


def check_str(name: str, value: object, choices: tuple[str, ...] = ()) -> None:
    if not isinstance(value, str) or (choices and value not in choices):
        want = f"one of {choices}" if choices else "a string"
        raise InvalidArgumentError(name, f"must be {want}, got {_shown(value)}")


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What one step's time depends on (see the module docstring)."""

    new_tokens: float
    attn: float  # sum of n_i * (c_i + (n_i + 1) / 2): query-key pairs over the batch
    context: float  # sum of c_i + n_i: KV tokens read
    seqs: float

    @classmethod
    def of(cls, rows: list[tuple[int, int]]) -> StepFeatures:
        """Features of a batch given as (new tokens, cached tokens) per sequence."""
        return cls(
            float(sum(n for n, _ in rows)),
            float(sum(n * (c + (n + 1) / 2) for n, c in rows)),
            float(sum(n + c for n, c in rows)),
            float(len(rows)),
        )


@dataclass(frozen=True)
class StepModel:
    """Step time in seconds from :class:`StepFeatures` (formula in the module docstring)."""

    overhead_s: float = 0.0
    s_per_token: float = 0.0
    s_per_attn: float = 0.0
    weights_s: float = 0.0
    s_per_ctx: float = 0.0
    s_per_seq: float = 0.0
    combine: str = "sum"
    cold_compute: float = 0.0
    cold_factor: float = 0.0
    cold_after_s: float = 0.05
    shared_compute: float = 0.0
    shared_factor: float = 0.0
    jitter: float = 0.0  # sim.jitter: the spread of a live step's time (sd of its log)
    jitter_s: float = 0.0  # and how long a deviation lasts (correlation time)

    def __post_init__(self) -> None:
        check_str("step.combine", self.combine, COMBINES)
        for name in ("overhead_s", "weights_s", "cold_after_s", "jitter_s"):  # seconds
            check_number(f"step.{name}", getattr(self, name))
        for name in ("s_per_token", "s_per_attn", "s_per_ctx", "s_per_seq"):  # per unit
            check_number(f"step.{name}", getattr(self, name))
        for name in ("cold_compute", "cold_factor", "shared_compute", "shared_factor"):
            check_number(f"step.{name}", getattr(self, name), MAX_FACTOR)
        check_number("step.jitter", self.jitter, MAX_JITTER)

    def time(self, f: StepFeatures) -> float:
        compute = self.s_per_token * f.new_tokens + self.s_per_attn * f.attn
        memory = self.weights_s + self.s_per_ctx * f.context
        body = compute + memory if self.combine == "sum" else max(compute, memory)
        return self.overhead_s + self.s_per_seq * f.seqs + body

    def compute_time(self, f: StepFeatures) -> float:
        """The compute terms of :meth:`time` (0 under ``max``: a roofline has no parts)."""
        if self.combine != "sum":
            return 0.0
        return self.s_per_token * f.new_tokens + self.s_per_attn * f.attn

    def live_time(self, f: StepFeatures, cold: bool, shared: bool) -> float:
        """:meth:`time` of a step after the instance sat idle (``cold``) or beside
        another instance's step on its host (``shared``)."""
        t = self.time(f)
        if not (cold or shared):
            return t
        compute = self.compute_time(f)
        c = self.cold_compute * cold + self.shared_compute * shared
        r = self.cold_factor * cold + self.shared_factor * shared
        return t + c * compute + r * (t - compute)

    @property
    def slows(self) -> bool:
        """Whether :meth:`live_time` can differ from :meth:`time`."""
        return any((self.cold_compute, self.cold_factor, self.shared_compute, self.shared_factor))

    def decode_run_time(self, seqs: int, context: int, steps: int) -> float:
        """Total time of ``steps`` pure decode steps of ``seqs`` sequences whose
        summed context is ``context`` before the first (it grows by ``seqs`` a step)."""
        if steps <= 0:
            return 0.0
        # step i: compute = a + b*i, memory = m + n*i (linear in i), both combined
        a, b, m, n = self._decode_lines(seqs, context)
        fixed = steps * (self.overhead_s + self.s_per_seq * seqs)
        if self.combine == "sum":
            return fixed + _linear_sum(a + m, b + n, 0, steps)
        if b == n:
            return fixed + _linear_sum(max(a, m), b, 0, steps)
        # the two lines cross once, at i = x: one bounds the steps before, the other after
        k = min(max(math.ceil((m - a) / (b - n)), 0), steps)
        early, late = ((m, n), (a, b)) if b > n else ((a, b), (m, n))
        return fixed + _linear_sum(*early, 0, k) + _linear_sum(*late, k, steps)

    def decode_step_times(self, seqs: int, context: int, steps: int) -> list[float]:
        """Each step's time of the pure decode run of ``decode_run_time``, in order."""
        a, b, m, n = self._decode_lines(seqs, context)
        fixed = self.overhead_s + self.s_per_seq * seqs
        if self.combine == "sum":
            return [fixed + (a + m) + (b + n) * i for i in range(steps)]
        return [fixed + max(a + b * i, m + n * i) for i in range(steps)]

    def decode_step_end(self, seqs: int, context: int, elapsed: float) -> tuple[int, float]:
        """(steps, their time) of the pure decode run above whose last step is the
        one in flight ``elapsed`` seconds after the run started (at least one)."""
        hi = 1
        while self.decode_run_time(seqs, context, hi) < elapsed:
            hi *= 2
        lo = hi // 2 + 1 if hi > 1 else 1  # the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if self.decode_run_time(seqs, context, mid) >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        return hi, self.decode_run_time(seqs, context, hi)

    def _decode_lines(self, seqs: int, context: int) -> tuple[float, float, float, float]:
        """(a, b, m, n): step i of a pure decode run computes for ``a + b*i`` seconds and
        reads memory for ``m + n*i``. Each sequence computes one token over its cached
        ones, so a step's attention pairs and KV tokens read are both context + seqs."""
        first = context + seqs  # attention pairs and KV tokens read by the first step
        a = self.s_per_token * seqs + self.s_per_attn * first
        m = self.weights_s + self.s_per_ctx * first
        return a, self.s_per_attn * seqs, m, self.s_per_ctx * seqs


def _linear_sum(c0: float, c1: float, lo: int, hi: int) -> float:
    """Sum of ``c0 + c1 * i`` over ``lo <= i < hi``."""
    k = hi - lo
    return k * c0 + c1 * (lo + hi - 1) * k / 2 if k > 0 else 0.0


@dataclass(frozen=True)
class TransferModel:
    """KV hand-off between two instances: ``latency_s + bytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        check_number("connectors.latency_s", self.latency_s)
        check_number("connectors.bytes_per_s", self.bytes_per_s, math.inf, 1.0)

    def time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


_DIMS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model a latency model depends on."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    num_experts: int = 0
    num_experts_per_tok: int = 0
    mlp_matrices: int = 3  # 3: a gated MLP (gate, up, down); 2: OPT's and GPT's fc1, fc2

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError("model.name", f"must be a name, got {_shown(self.name)}")
        for name in _DIMS:
            check_int(f"model.{name}", getattr(self, name), MAX_DIM)
        check_int("model.num_kv_heads", self.num_kv_heads, self.num_heads)
        check_int("model.num_experts", self.num_experts, MAX_DIM, 0)
        lo = 1 if self.num_experts else 0
        check_int("model.num_experts_per_tok", self.num_experts_per_tok, self.num_experts, lo)
        check_int("model.mlp_matrices", self.mlp_matrices, 3, 2)

    @property
    def architecture(self) -> str:  # what a layout check names (core/layout.py)
        return self.name

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def params(self) -> int:
        """Weights read per token (active experts only)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = self.mlp_matrices * self.hidden_size * self.intermediate_size
        mlp *= max(1, self.num_experts_per_tok)
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def signature(self) -> dict[str, int]:
        keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")
        return {k: int(getattr(self, k)) for k in keys}


@dataclass(frozen=True)
class Sample:
    """One measured step: its features, phase ("prefill"/"decode") and median seconds."""

    phase: str
    features: StepFeatures
    seconds: float


@dataclass(frozen=True)
class Profile:
    """Everything the simulator needs to time one instance of one layout."""

    model: ModelShape
    tensor_parallel_size: int
    pipeline_parallel_size: int
    device: str
    source: str
    step: StepModel
    kv_bytes_per_token: int  # K and V of every layer, whole instance
    kv_capacity_tokens: int  # tokens of KV the instance holds
    dtype: str = "bfloat16"
    connectors: dict[str, TransferModel] = field(default_factory=dict)
    samples: tuple[Sample, ...] = ()
    fit_error: dict[str, float] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    date: str = ""
    # What a live calibration (``pdserve sim-validate --write-profiles``) adds: each
    # role's steps as its engine ran them, a request's cost outside the steps and its
    # noise, and whether the instances shared one host (their steps slow each other)
    role_steps: dict[str, StepModel] = field(default_factory=dict)
    request_overhead_s: float = 0.0
    request_jitter: float = 0.0
    one_host: bool = False

    def __post_init__(self) -> None:
        check_str("source", self.source, SOURCES)
        check_str("device", self.device)
        check_str("dtype", self.dtype, DTYPES)
        for name in ("command", "date"):
            check_str(name, getattr(self, name))
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            check_int(name, getattr(self, name), MAX_RANKS)
        for name in ("kv_bytes_per_token", "kv_capacity_tokens"):
            check_int(name, getattr(self, name), MAX_COUNT)
        check_number("request_overhead_s", self.request_overhead_s)
        check_number("request_jitter", self.request_jitter, MAX_JITTER)
        if not isinstance(self.one_host, bool):
            raise InvalidArgumentError(
                "one_host", f"must be true or false, got {_shown(self.one_host)}"
            )
        if not isinstance(self.machine, dict):
            raise InvalidArgumentError("machine", f"must be an object, got {_shown(self.machine)}")
        if set(self.role_steps) - set(PHASES):
            raise InvalidArgumentError("role_steps", "roles are prefill and decode")
        for table in ("fit_error", "efficiency"):
            for key, value in _as_dict(getattr(self, table), table).items():
                check_number(f"{table}.{_key(key)}", value, math.inf)

    @property
    def devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def transfer(self, connector: str) -> TransferModel:
        connector = resolve_connector(connector, "cpu" if self.device == "cpu" else "cuda")
        if found := self.connectors.get(connector, self.connectors.get("default")):
            return found
        raise InvalidArgumentError(
            "connector",
            f"the profile has no transfer model for {connector!r} "
            f"(it has {sorted(self.connectors)}); profile that connector or add it",
        )

    def check_matches(self, model: ModelShape, tp: int, pp: int, where: str = "profile") -> None:
        """Raise InvalidArgumentError unless this profile describes ``model`` at tp x pp."""
        mine, theirs = self.model.signature(), model.signature()
        diff = [f"{k}={mine[k]} (model has {theirs[k]})" for k in mine if mine[k] != theirs[k]]
        if diff:
            raise InvalidArgumentError(
                where,
                f"profiles model {self.model.name!r}, not {model.name!r}: " + ", ".join(diff),
            )
        if (self.tensor_parallel_size, self.pipeline_parallel_size) != (tp, pp):
            raise InvalidArgumentError(
                where,
                f"profiles layout tp={self.tensor_parallel_size} pp={self.pipeline_parallel_size}, "
                f"the config asks for tp={tp} pp={pp}: profile that layout "
                "(pdserve profile --tp/--pp, or --device for an analytic one)",
            )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["version"] = PROFILE_VERSION
        return out


def save_profile(profile: Profile, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_json(), indent=1))
    return out


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file; InvalidArgumentError names the bad field."""
    file = Path(path)
    if not file.is_file():
        raise InvalidArgumentError("profile", f"no such file: {file}")
    try:
        raw = json.loads(file.read_text())
    except (ValueError, RecursionError) as e:  # undecodable, not JSON, nested past the stack
        raise InvalidArgumentError("profile", f"{file}: not JSON: {e}") from None
    try:
        return profile_from_json(raw)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{file}: {e.field}", e.message) from None


_PARTS = ("model", "step", "connectors", "samples", "role_steps")


def profile_from_json(raw: Any) -> Profile:
    """The profile a JSON object describes; InvalidArgumentError names the first bad
    field (a missing or unknown one, a wrong type, a value out of its range)."""
    if not isinstance(raw, dict):
        raise InvalidArgumentError("profile", "must be a JSON object")
    version = raw.get("version")
    if type(version) is not int or version != PROFILE_VERSION:
        raise InvalidArgumentError("version", f"must be {PROFILE_VERSION}, got {_shown(version)}")
    known = {f.name for f in fields(Profile)} | {"version"}
    if unknown := sorted(set(raw) - known):
        raise InvalidArgumentError(_key(unknown[0]), "is not a field of a profile")
    model = _build(ModelShape, _obj(raw, "model"), "model", "model")
    step = _build(StepModel, _obj(raw, "step"), "step", "step")
    connectors = {
        k: _build(TransferModel, v, f"connectors.{_key(k)}", "connectors")
        for k, v in _obj(raw, "connectors").items()
    }
    roles = {
        k: _build(StepModel, v, f"role_steps.{_key(k)}", "step")
        for k, v in _as_dict(raw.get("role_steps", {}), "role_steps").items()
    }
    samples = raw.get("samples", [])
    if not isinstance(samples, (list, tuple)):  # JSON's, or to_json's
        raise InvalidArgumentError("samples", f"must be a list, got {_shown(samples)}")
    rest = {k: raw[k] for k in known - {"version", *_PARTS} if k in raw}
    missing = sorted(f.name for f in fields(Profile) if f.name not in raw and _required(f))
    if missing:
        raise InvalidArgumentError(missing[0], "is missing")
    return Profile(
        model=model,
        step=step,
        connectors=connectors,
        role_steps=roles,
        samples=tuple(_sample(x, f"samples[{i}]") for i, x in enumerate(samples)),
        **rest,
    )


def _required(f: Any) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _build(cls: Any, value: Any, where: str, own: str) -> Any:
    """``cls(**value)`` for the object at ``where``, its errors named there (``cls``
    names its fields under ``own``)."""
    value = _as_dict(value, where)
    names = {f.name for f in fields(cls)}
    if unknown := sorted(set(value) - names):
        raise InvalidArgumentError(f"{where}.{_key(unknown[0])}", "is not a field here")
    if missing := sorted(f.name for f in fields(cls) if _required(f) and f.name not in value):
        raise InvalidArgumentError(f"{where}.{missing[0]}", "is missing")
    try:
        return cls(**value)
    except InvalidArgumentError as e:
        if e.field.startswith(own + "."):
            raise InvalidArgumentError(where + e.field[len(own) :], e.message) from None
        raise


def _sample(raw: Any, where: str) -> Sample:
    raw = _as_dict(raw, where)
    if unknown := sorted(set(raw) - {"phase", "features", "seconds"}):
        raise InvalidArgumentError(f"{where}.{_key(unknown[0])}", "is not a field here")
    check_str(f"{where}.phase", raw.get("phase"), PHASES)
    features = _as_dict(raw.get("features"), f"{where}.features")
    names = [f.name for f in fields(StepFeatures)]
    if unknown := sorted(set(features) - set(names)):
        raise InvalidArgumentError(f"{where}.features.{_key(unknown[0])}", "is not a field here")
    for name in names:
        check_number(f"{where}.features.{name}", features.get(name), MAX_COUNT)
    check_number(f"{where}.seconds", raw.get("seconds"), above=True)
    values = [float(features[n]) for n in names]
    return Sample(raw["phase"], StepFeatures(*values), float(raw["seconds"]))


def _obj(raw: dict[str, Any], key: str) -> dict[str, Any]:
    if key not in raw:
        raise InvalidArgumentError(key, "is missing")
    return _as_dict(raw[key], key)


def _as_dict(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgumentError(key, f"must be an object, got {_shown(value)}")
    return value
