"""Weight-only int8 and int4 against float32 on one model, side by side in one run.

    pdserve bench quant --model builtin:pycode

- ``weights``: bytes of the model's weights as each engine holds them.
- ``matmul``: microseconds per call of each dense linear's shape at 1 and 16 rows:
  float32 ``F.linear``, float32 oneDNN packed (what a float32 engine uses on the
  CPU), the int8 and int4 CPU paths, and ``torch._weight_int8pack_mm`` on
  float32 activations (the unvectorised code the int8 path avoids).
- ``decode``: B greedy requests (32-token prompts, ``--decode-tokens`` = N new
  tokens) at B = 1 and 16; decode tokens/s is ``B * (N - 1)`` over the time a
  run of N tokens takes beyond a run of 1 on the same prompts (prefix caching
  off), median of ``--repeats`` runs; ``prefill_tok_s``: prompt tokens/s of
  one step prefilling 8 prompts of 128 tokens.
- ``perplexity``: of held-out text under each engine's own forward pass, over
  non-overlapping windows of ``--context`` tokens. The text is ``--text`` files,
  else the held-out files a ``training.json`` in the model folder lists (the
  Python standard library, ``builtin:pycode``), else the built-in tokenizer corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.bench.flags import count
from pdserve.bench.report import write_json
from pdserve.core.options import options_from

_PROMPT_TOKENS = 32
_BATCHES = (1, 16)
_SCHEMES = ("none", "int8", "int4")
_PREFILL_PROMPTS, _PREFILL_TOKENS = 8, 128  # one step of the default 1024-token budget


@dataclass(frozen=True)
class QuantOptions:
    """``pdserve bench quant``'s options, in the order of its flags."""

    model: str = "builtin:small"  # the model quantized
    decode_tokens: int = 64  # new tokens per request
    repeats: int = 3  # decode runs per batch size (median)
    context: int = 256  # tokens per perplexity window
    windows: int = 64  # perplexity windows
    iters: int = 200  # calls per matmul timing
    text: list[str] = field(default_factory=list)  # held-out text files
    seed: int = 0  # seeds the prompts
    out: str = "bench/out/quant.json"  # the result file ("": none)


def _time_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - start) / iters * 1e6)
    return min(runs)


def linear_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each dense linear of one layer."""
    m = model_config
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    return {
        "qkv": (qkv, m.hidden_size),
        "o": (m.hidden_size, m.num_heads * m.head_dim),
        "gate_up": (2 * m.intermediate_size, m.hidden_size),
        "down": (m.hidden_size, m.intermediate_size),
    }


def matmul_timings(w: torch.Tensor, x: torch.Tensor, iters: int) -> dict[str, float]:
    """Microseconds per call of ``x @ w.T`` on each path; w [out, in], x [rows, in]."""
    from pdserve.kernels.cpu_linear import _pack, packed_linear
    from pdserve.models.quant import QUANT_PATHS, cpu_int8pack_matmul, quantize_weight

    packed, (q, scale) = _pack(w), quantize_weight(w)
    int4 = QUANT_PATHS["int4", "torch"]
    stored = int4.prepare(w)
    return {
        "f32_linear_us": _time_us(lambda: F.linear(x, w), iters),
        "f32_onednn_us": _time_us(lambda: packed_linear(x, packed, None), iters),
        "int8_path_us": _time_us(lambda: cpu_int8pack_matmul(x, q, scale), iters),
        "int4_path_us": _time_us(lambda: int4.matmul(x, stored), iters),
        "int8pack_f32_us": _time_us(
            lambda: torch._weight_int8pack_mm(x, q, scale), max(1, iters // 10)
        ),
    }


def bench_matmuls(model_config: Any, iters: int) -> list[dict[str, Any]]:
    rows_out: list[dict[str, Any]] = []
    for name, (out, inp) in linear_shapes(model_config).items():
        w = torch.randn(out, inp) * 0.05
        for rows in _BATCHES:
            times = matmul_timings(w, torch.randn(rows, inp), iters)
            rows_out.append(
                {"linear": name, "out": out, "in": inp, "rows": rows}
                | {k: round(v, 1) for k, v in times.items()}
            )
    return rows_out


def decode_tokens_per_s(llm: Any, vocab: int, batch: int, new_tokens: int, seed: int) -> float:
    """``batch * (new_tokens - 1)`` over the time a run of ``new_tokens`` takes beyond a run of 1."""
    from pdserve import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(_PROMPT_TOKENS)] for _ in range(batch)]

    def seconds(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    prefill_only = seconds(1)
    return batch * (new_tokens - 1) / (seconds(new_tokens) - prefill_only)


def prefill_tokens_per_s(llm: Any, vocab: int, seed: int) -> float:
    """Prompt tokens/s of one step that prefills ``_PREFILL_PROMPTS`` x ``_PREFILL_TOKENS`` tokens."""
    from pdserve import SamplingParams

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(_PREFILL_TOKENS)] for _ in range(_PREFILL_PROMPTS)
    ]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return _PREFILL_PROMPTS * _PREFILL_TOKENS / (time.perf_counter() - start)


def held_out_texts(folder: Path, files: list[str]) -> tuple[str, list[str]]:
    """(what the text is, the texts) for the perplexity figure."""
    if files:
        return "files " + ", ".join(files), [Path(f).read_text(errors="replace") for f in files]
    record = folder / "training.json"
    if record.is_file():
        data = json.loads(record.read_text())["data"]
        root = Path(sysconfig.get_paths()["stdlib"])
        names = data["held_out_files"]
        texts = [(root / n).read_text("utf-8", errors="replace") for n in names]
        return f"{len(names)} held-out files of {data['source']}", texts
    corpus = resources.files("pdserve.models").joinpath("data/tiny_corpus.txt").read_text()
    return "the built-in tokenizer corpus (models/data/tiny_corpus.txt)", [corpus]


def token_windows(folder: Path, texts: list[str], context: int, count: int) -> list[list[int]]:
    """Non-overlapping windows of ``context`` tokens of ``[BOS] text [EOS]...``, ``count`` spread evenly."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id", 1)
    stream: list[int] = []
    for enc in tok.encode_batch(texts):
        stream.extend(enc.ids)
        stream.append(eos if isinstance(eos, int) else eos[0])
    n = len(stream) // context
    if count >= n:
        picks = list(range(n))
    else:
        picks = sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})
    return [stream[i * context : (i + 1) * context] for i in picks]


@torch.no_grad()
def perplexity(llm: Any, windows: list[list[int]], block_size: int) -> float:
    """exp(mean next-token loss) of the engine's own forward pass over ``windows``."""
    from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan

    runner = llm.engine.executor.runner
    total, count = 0.0, 0
    for i, window in enumerate(windows):
        blocks = list(range(-(-len(window) // block_size)))
        plan = StepPlan(i, [ScheduledSeq(f"w{i}", window, 0, blocks, RowSampling())])
        batch = runner.prepare(plan)
        hidden, _ = runner.model(batch.input_ids, batch.positions, runner.caches, batch.meta)
        logits = runner.model.compute_logits(hidden[:-1]).float()  # [S-1, vocab]
        target = torch.tensor(window[1:], device=logits.device)
        total += float(F.cross_entropy(logits, target, reduction="sum"))
        count += len(window) - 1
    return math.exp(total / count)


def build_engine(model: str, quantization: str) -> Any:
    from pdserve import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        quantization=quantization,
        max_num_seqs=max(_BATCHES),
        enable_prefix_caching=False,  # every timed run prefills its prompts in full
    )
    llm.generate([[5] * 8], SamplingParams(max_tokens=4))  # warm-up
    return llm


def measure_engines(args: QuantOptions, windows: list[list[int]]) -> list[dict[str, Any]]:
    """One row per engine (float32, int8, int4); their decode runs alternate, so all meet the same load."""
    llms = {q: build_engine(args.model, q) for q in _SCHEMES}
    runs: dict[tuple[str, int], list[float]] = {}
    for r in range(args.repeats):
        for q, llm in llms.items():
            vocab = llm.engine.executor.runner.model_config.vocab_size
            for batch in _BATCHES:
                tok_s = decode_tokens_per_s(llm, vocab, batch, args.decode_tokens, args.seed + r)
                runs.setdefault((q, batch), []).append(tok_s)
            runs.setdefault((q, 0), []).append(prefill_tokens_per_s(llm, vocab, args.seed + r))
    rows = []
    for q, llm in llms.items():
        row: dict[str, Any] = {
            "quantization": q,
            "weights_bytes": llm.engine.executor.runner.weights_bytes,
        }
        for batch in _BATCHES:
            row[f"decode_b{batch}_tok_s"] = round(statistics.median(runs[q, batch]), 1)
            row[f"decode_b{batch}_runs"] = [round(v, 1) for v in runs[q, batch]]
        row["prefill_tok_s"] = round(statistics.median(runs[q, 0]), 1)
        row["perplexity"] = round(perplexity(llm, windows, 16), 4)
        llm.engine.assert_idle()
        rows.append(row)
    return rows


def versus(base: dict[str, Any], quant: dict[str, Any]) -> dict[str, float]:
    """The quantized engine's figures as ratios (percent for perplexity) of float32's."""
    ratios = {
        key.replace("_tok_s", "_speedup").replace("_bytes", "_ratio"): quant[key] / base[key]
        for key in base
        if key.endswith(("_tok_s", "_bytes"))
    }
    out = {k: round(v, 3) for k, v in ratios.items()}
    out["perplexity_change_pct"] = round(100 * (quant["perplexity"] / base["perplexity"] - 1), 3)
    return out


def run(args: argparse.Namespace) -> int:
    return benchmark(options_from(QuantOptions, args))


def benchmark(args: QuantOptions) -> int:
    """Each engine's speed and perplexity, the matmuls, and the ratios; the report written."""
    from pdserve.core.model_config import ModelConfig
    from pdserve.models.builtin import resolve_model

    torch.manual_seed(args.seed)
    folder = resolve_model(args.model)
    model_config = ModelConfig.from_dir(folder)
    context = min(args.context, model_config.max_position_embeddings)
    source, texts = held_out_texts(folder, args.text)
    windows = token_windows(folder, texts, context, args.windows)
    engines = measure_engines(args, windows)
    summary = {quant["quantization"]: versus(engines[0], quant) for quant in engines[1:]}
    report = {
        "command": "pdserve bench quant " + " ".join(_flags(args)),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "perplexity_text": f"{source}: {len(windows)} windows of {context} tokens",
        "engines": engines,
        "summary": summary,
        "matmuls": bench_matmuls(model_config, args.iters),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        print(f"wrote {write_json(Path(args.out), report)}")
    return 0


def _flags(args: QuantOptions) -> list[str]:
    names = ("model", "decode_tokens", "repeats", "context", "windows", "iters", "seed")
    flags = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in names]
    return flags + [f"--text {t}" for t in args.text]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--decode-tokens", type=count, default=64, help="new tokens per request")
    p.add_argument("--repeats", type=count, default=3, help="decode runs per batch size (median)")
    p.add_argument("--context", type=count, default=256, help="tokens per perplexity window")
    p.add_argument("--windows", type=count, default=64, help="perplexity windows")
    p.add_argument("--iters", type=count, default=200, help="calls per matmul timing")
    p.add_argument("--text", action="append", default=[], help="held-out text file (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/quant.json")
    p.set_defaults(func=run)
