"""Training of ``builtin:pycode``, a small Llama-shaped model of Python source, and of
its draft model ``builtin:pycode-draft`` (speculative decoding).

    python -m pdserve.models.pycode_train --out models/data/pycode
    python -m pdserve.models.pycode_train --preset draft --out models/data/pycode-draft

Data: the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``) without its tests, third-party packages
and generated tables (``SKIP_DIRS``), sorted by path. The split is by file and
the same on every Python version: a file is held out when the CRC-32 of its
path relative to the library is 0 modulo ``held_out_every``.

Tokenizer: the built-in models' byte-level BPE (same special tokens and chat
template) trained on the training files; or, with ``tokenizer`` set (the draft
preset), the tokenizer of that checkpoint copied as it is, so the draft proposes
ids the target reads. Each file is encoded as
``<|begin_of_text|> source <|end_of_text|>``; the files are concatenated into
one stream and a step samples ``batch_size`` random windows of it.

Model: ``transformers``' ``LlamaForCausalLM`` (a test dependency, used here
only to train), AdamW with linear warmup and cosine decay, stopped after
``steps`` or the wall-clock budget. The folder written is an ordinary Hugging
Face checkpoint in float32 (the built-in models' layout, see
``pdserve.models.builtin``) plus ``loss.png``, ``training.json`` and a
model card, ``README.md`` (``pdserve.models.pycode_card``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pdserve.models.builtin import (
    EOS,
    BuiltinSpec,
    hf_config,
    resolve_model,
    train_tokenizer,
    write_tokenizer_files,
)
from pdserve.models.pycode_card import training_record, write_card, write_loss_plot

log = logging.getLogger(__name__)

# Folder names skipped anywhere under the library: tests and third-party code;
# the IDLE and turtle demos, bundled wheels, and generated tables (codecs, pydoc topics).
_TESTS_AND_THIRD_PARTY = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
_APPS_AND_TABLES = {"idlelib", "turtledemo", "ensurepip", "encodings", "pydoc_data", "__pycache__"}
SKIP_DIRS = frozenset(_TESTS_AND_THIRD_PARTY | _APPS_AND_TABLES)
SKIP_PREFIXES = ("config-", "_sysconfigdata")

# Option defaults per ``--preset``: the model and a draft model for it (same
# tokenizer, a fraction of the compute per token; trained for a few minutes).
PRESETS: dict[str, dict[str, Any]] = {
    "pycode": {},
    "draft": {
        "name": "pycode-draft",
        "tokenizer": "builtin:pycode",
        "hidden_size": 96,
        "num_layers": 2,
        "num_heads": 3,
        "num_kv_heads": 1,
        "intermediate_size": 256,
        "steps": 1400,
        "minutes": 7.0,
        "lr": 5e-3,
        "eval_every": 250,
    },
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (recorded in ``training.json``).

    out: folder the checkpoint is written to.
    steps: optimizer steps the learning-rate schedule is planned for.
    minutes: wall-clock budget of the optimizer loop; it stops early when spent.
    seed: seeds the initial weights and the sampled windows.
    vocab_size: BPE vocabulary, special tokens included.
    context: tokens per training window.
    max_positions: the checkpoint's position limit; RoPE runs past ``context``, with
        text that gets worse the further it goes.
    batch_size: windows per step.
    lr, min_lr_ratio, warmup_steps: peak rate, floor of the cosine, linear warmup.
    weight_decay, grad_clip: AdamW decay of the matrices; gradient-norm clip.
    eval_every, eval_windows: held-out loss every so many steps, on so many windows.
    threads: torch intra-op threads.
    held_out_every: one file in this many (by CRC-32 of its path) is held out.
    name: the built-in name the checkpoint ships as (``builtin:<name>``).
    tokenizer: a checkpoint folder or ``builtin:`` name whose tokenizer is copied;
        empty: train one on the training files.
    """

    out: Path
    steps: int = 1100
    minutes: float = 15.0
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 512
    context: int = 256
    max_positions: int = 1024
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    threads: int = 2
    held_out_every: int = 20
    name: str = "pycode"
    tokenizer: str = ""

    def __post_init__(self) -> None:
        if self.max_positions < self.context:
            raise ValueError(
                f"max_positions ({self.max_positions}) is below context ({self.context})"
            )
        for name in ("steps", "context", "batch_size", "eval_every", "threads", "held_out_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class Corpus:
    """The library's files split by the held-out rule; paths relative to ``root``."""

    root: Path
    train: list[str]
    held_out: list[str]

    def texts(self, names: list[str]) -> list[str]:
        return [(self.root / n).read_text("utf-8", errors="replace") for n in names]


@dataclass
class TrainLog:
    """What the optimizer loop saw: one train loss per step, held-out loss at some steps."""

    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    wall_s: float = 0.0
    stopped_by: str = "steps"


def is_held_out(name: str, every: int) -> bool:
    return zlib.crc32(name.encode()) % every == 0


def stdlib_corpus(held_out_every: int, root: Path | None = None) -> Corpus:
    """The standard library's ``.py`` files (``SKIP_DIRS`` left out), sorted and split."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    names = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.parts[:-1]
        if any(p in SKIP_DIRS or p.startswith(SKIP_PREFIXES) for p in parts):
            continue
        if not rel.name.startswith(SKIP_PREFIXES):
            names.append(rel.as_posix())
    held = [n for n in names if is_held_out(n, held_out_every)]
    train = [n for n in names if not is_held_out(n, held_out_every)]
    return Corpus(root=root, train=train, held_out=held)


def token_stream(tok: Any, texts: list[str]) -> torch.Tensor:
    """``[BOS] file [EOS]`` for each text, concatenated. Shape [T], int64."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_spec(cfg: TrainConfig) -> BuiltinSpec:
    return BuiltinSpec(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        vocab_target=cfg.vocab_size,
        max_position_embeddings=cfg.max_positions,
        seed=cfg.seed,
    )


def checkpoint_config(
    cfg: TrainConfig, vocab: int, bos: int | None, eos: int | None
) -> dict[str, object]:
    """The built-in models' ``config.json`` with plain RoPE and a note that it was trained."""
    config = hf_config(model_spec(cfg), vocab, bos, eos)
    del config["rope_scaling"]
    config["rope_theta"] = 10000.0
    config["pdserve_note"] = (
        "trained by pdserve.models.pycode_train on the Python standard library; see README.md"
    )
    return config


def build_model(config: dict[str, object], seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf: dict[str, Any] = {
        k: v for k, v in config.items() if k not in ("pdserve_note", "torch_dtype")
    }
    return LlamaForCausalLM(LlamaConfig(**hf))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def window_loss(model: Any, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of windows [B, S+1] (inputs [B, S], targets [B, S])."""
    logits = model(input_ids=windows[:, :-1]).logits  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


def sample_windows(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - cfg.context - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s : s + cfg.context + 1] for s in starts.tolist()])  # [B, S+1]


def held_out_windows(stream: torch.Tensor, context: int, count: int | None) -> torch.Tensor:
    """Non-overlapping windows [N, S+1] of the held-out stream (all of them, or ``count``
    spread evenly over it)."""
    n = (len(stream) - 1) // context
    starts = torch.arange(n) * context
    if count is not None and count < n:
        starts = starts[torch.linspace(0, n - 1, count).long()]
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: Any, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss (nats) over ``windows`` [N, S+1]."""
    model.eval()
    total = sum(
        window_loss(model, windows[i : i + batch_size]).item() * len(windows[i : i + batch_size])
        for i in range(0, len(windows), batch_size)
    )
    model.train()
    return total / len(windows)


def optimizer(model: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(model: Any, train: torch.Tensor, held: torch.Tensor, cfg: TrainConfig) -> TrainLog:
    """The optimizer loop; returns its log."""
    opt = optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_set = held_out_windows(held, cfg.context, cfg.eval_windows)
    out = TrainLog(tokens_per_step=cfg.batch_size * cfg.context)
    start = time.monotonic()
    model.train()
    for step in range(cfg.steps):
        if time.monotonic() - start > cfg.minutes * 60:
            out.stopped_by = "time"
            break
        loss = window_loss(model, sample_windows(train, cfg, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        out.train_loss.append(loss.item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            out.eval_steps.append(step + 1)
            out.eval_loss.append(evaluate(model, eval_set, cfg.batch_size))
            log.info("step %d eval loss %.3f", step + 1, out.eval_loss[-1])
        if step % 10 == 0:
            rate = (step + 1) * out.tokens_per_step / (time.monotonic() - start)
            lr = sched.get_last_lr()[0]
            log.info("step %d loss %.3f lr %.2e %.0f tok/s", step, loss.item(), lr, rate)
    out.wall_s = time.monotonic() - start
    return out


def save_weights(model: Any, folder: Path) -> int:
    """float32 safetensors under the Llama names pdserve loads (the tied head is not stored)."""
    state = {
        name: t.detach().to(torch.float32).contiguous().clone()
        for name, t in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)
    return sum(t.numel() for t in state.values())


def load_tokenizer(cfg: TrainConfig, train_texts: list[str]) -> Any:
    """The ``tokenizer`` checkpoint's tokenizer, or a new one trained on ``train_texts``."""
    if not cfg.tokenizer:
        return train_tokenizer(cfg.vocab_size, train_texts)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(resolve_model(cfg.tokenizer) / "tokenizer.json"))


def run(cfg: TrainConfig, command: str) -> dict[str, Any]:
    """Train, write the checkpoint folder, and return what ``training.json`` records."""
    torch.set_num_threads(cfg.threads)
    corpus = stdlib_corpus(cfg.held_out_every)
    train_texts, held_texts = corpus.texts(corpus.train), corpus.texts(corpus.held_out)
    started = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg, train_texts)
    bos, eos = write_tokenizer_files(tok, cfg.out, cfg.max_positions)
    if cfg.tokenizer:  # byte for byte the source's file
        shutil.copyfile(resolve_model(cfg.tokenizer) / "tokenizer.json", cfg.out / "tokenizer.json")
    train_ids, held_ids = token_stream(tok, train_texts), token_stream(tok, held_texts)
    log.info("%d train tokens, %d held-out tokens", len(train_ids), len(held_ids))
    config = checkpoint_config(cfg, tok.get_vocab_size(), bos, eos)
    (cfg.out / "config.json").write_text(json.dumps(config, indent=2))
    model = build_model(config, cfg.seed)
    history = train(model, train_ids, held_ids, cfg)
    held_loss = evaluate(model, held_out_windows(held_ids, cfg.context, None), cfg.batch_size)
    params = save_weights(model, cfg.out)
    files = (corpus.train, corpus.held_out)
    record = training_record(cfg, command, files, history, SKIP_DIRS)
    record["data"]["tokens"] = {"train": len(train_ids), "held_out": len(held_ids)}
    record["result"] = {
        "parameters": params,
        "final_train_loss": sum(history.train_loss[-50:]) / len(history.train_loss[-50:]),
        "held_out_loss": held_loss,
        "held_out_perplexity": math.exp(held_loss),
        "total_wall_s": time.monotonic() - started,
    }
    (cfg.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_loss_plot(history, cfg.out / "loss.png", cfg.name)
    write_card(record, cfg.out / "README.md")
    return record


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="pycode", help="option defaults")
    preset = p.parse_known_args(argv)[0].preset
    defaults = TrainConfig(out=Path(), **PRESETS[preset])
    for name, value in asdict(defaults).items():
        if name != "out":
            flag = "--" + name.replace("_", "-")
            p.add_argument(flag, type=type(value), default=value, help=f"default {value}")
    args = vars(p.parse_args(argv))
    del args["preset"]
    return TrainConfig(**args)


def main(argv: list[str] | None = None) -> None:
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = parse_args(argv)
    args = sys.argv[1:] if argv is None else argv
    record = run(cfg, "python -m pdserve.models.pycode_train " + " ".join(args))
    log.info("result: %s", json.dumps(record["result"]))


if __name__ == "__main__":
    main()
