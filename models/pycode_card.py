"""The model card (``README.md``), loss curve (``loss.png``) and record of a trained
built-in model (``builtin:pycode``, and its draft model ``builtin:pycode-draft``).

All three are written by ``pdserve.models.pycode_train`` from the run's record
(the dict it saves as ``training.json``) and its loss history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch


class LossHistory(Protocol):
    train_loss: list[float]
    eval_steps: list[int]
    eval_loss: list[float]
    tokens_per_step: int
    wall_s: float
    stopped_by: str


def training_record(
    cfg: Any,
    command: str,
    files: tuple[list[str], list[str]],
    history: LossHistory,
    skipped: Iterable[str],
) -> dict[str, Any]:
    """What ``training.json`` records (``cfg``: the run's ``TrainConfig``; ``files``:
    the training and held-out files; ``skipped``: folder names left out of the data)."""
    import platform
    import sys

    steps = len(history.train_loss)
    train, held_out = files
    return {
        "command": command,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "data": {
            "source": f"Python {platform.python_version()} standard library (*.py)",
            "skipped_folders": sorted(skipped),
            "split": f"held out when zlib.crc32(relative path) % {cfg.held_out_every} == 0",
            "files": {"train": len(train), "held_out": len(held_out)},
            "held_out_files": held_out,
        },
        "training": {
            "steps": steps,
            "tokens_seen": steps * history.tokens_per_step,
            "stopped_by": history.stopped_by,
            "loop_wall_s": history.wall_s,
            "train_loss": [round(x, 4) for x in history.train_loss],
            "eval_steps": history.eval_steps,
            "eval_loss": [round(x, 4) for x in history.eval_loss],
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": cfg.threads,
            "python": sys.version.split()[0],
        },
    }


def write_loss_plot(history: LossHistory, path: Path, name: str, smooth: int = 20) -> None:
    """Train loss (raw and a moving average) and held-out loss against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = history.tokens_per_step / 1e6
    raw = history.train_loss
    avg = [sum(raw[max(0, i - smooth + 1) : i + 1]) / min(i + 1, smooth) for i in range(len(raw))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = [(i + 1) * per for i in range(len(raw))]
    ax.plot(x, raw, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(x, avg, color="tab:blue", label=f"train (mean of {smooth} steps)")
    ax.plot(
        [s * per for s in history.eval_steps],
        history.eval_loss,
        "o-",
        color="tab:orange",
        label="held-out files",
    )
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(f"builtin:{name} on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_card(record: dict[str, Any], path: Path) -> None:
    cfg, data, result = record["config"], record["data"], record["result"]
    training, machine = record["training"], record["machine"]
    name = cfg.get("name", "pycode")
    intro = DRAFT_INTRO if cfg.get("tokenizer") else INTRO
    path.write_text(
        CARD.format(
            name=name,
            intro=intro.format(params=result["parameters"] / 1e6, cfg=cfg),
            source=data["source"],
            skipped=", ".join(f"`{d}`" for d in data["skipped_folders"]),
            split=data["split"].replace("held out when ", ""),
            train_files=data["files"]["train"],
            held_files=data["files"]["held_out"],
            train_tokens=data["tokens"]["train"] / 1e6,
            held_tokens=data["tokens"]["held_out"] / 1e3,
            command=record["command"],
            steps_done=training["steps"],
            tokens_seen=training["tokens_seen"] / 1e6,
            minutes=training["loop_wall_s"] / 60,
            rate=training["tokens_seen"] / training["loop_wall_s"],
            stopped_by="the wall-clock budget" if training["stopped_by"] == "time" else "steps",
            train_loss=result["final_train_loss"],
            held_loss=result["held_out_loss"],
            ppl=result["held_out_perplexity"],
            machine=f"{machine['processor']}, {machine['threads']} threads, torch "
            f"{machine['torch']}, Python {machine['python']}",
            cfg=cfg,
        )
    )


INTRO = """\
A Llama-shaped causal language model of {params:.2f} M parameters, trained from
scratch on Python source, with a {cfg[vocab_size]}-token byte-level BPE tokenizer
trained on the same text. pdserve ships it so that its examples and its demo print
recognisable code-like text without downloading anything:
`pdserve.LLM(model="builtin:pycode")`."""

DRAFT_INTRO = """\
A Llama-shaped causal language model of {params:.2f} M parameters, trained from
scratch on Python source with the tokenizer of `{cfg[tokenizer]}` (copied, not
retrained: same vocabulary, same ids). pdserve ships it as the draft model of
speculative decoding for `{cfg[tokenizer]}`:
`pdserve.LLM(model="{cfg[tokenizer]}", speculative_method="draft",
speculative_draft_model="builtin:{cfg[name]}")`. It proposes tokens cheaply; the
target verifies every one of them, so what it gets wrong costs time, never text."""

CARD = """\
# builtin:{name}

{intro}

| shape | |
| --- | --- |
| hidden size | {cfg[hidden_size]} |
| layers | {cfg[num_layers]} |
| attention heads / KV heads | {cfg[num_heads]} / {cfg[num_kv_heads]} |
| MLP (SwiGLU) | {cfg[intermediate_size]} |
| embeddings | tied |
| positions | plain RoPE (theta 10000), trained on {cfg[context]}-token windows, limit {cfg[max_positions]} |
| weights | float32, `model.safetensors` |

It is a toy for demos and measurements. It continues Python source (imports,
`def` and `class` lines, docstrings, indentation) with no notion of whether the
code runs; it does not follow instructions, it has seen no text other than the
standard library, and it was trained on windows of {cfg[context]} tokens: it
accepts up to {cfg[max_positions]} positions (prompt and output together), with
text that gets worse past {cfg[context]}.

## Data and licence

The training text is the source of the {source}, which is
distributed under the **PSF License Agreement** (Python Software Foundation
License Version 2; https://docs.python.org/3/license.html). Folders named
{skipped} are left out.

The split is by file: a file is held out when
`{split}`, its path taken relative to the library. That gives
{train_files} training files ({train_tokens:.2f} M tokens) and {held_files}
held-out files ({held_tokens:.0f} k tokens), listed in `training.json`. Each
file is one sequence, `<|begin_of_text|> source <|end_of_text|>`.

## Training

```
{command}
```

AdamW (betas 0.9 and 0.95, weight decay {cfg[weight_decay]} on matrices), peak
learning rate {cfg[lr]} after {cfg[warmup_steps]} warmup steps, cosine decay to
{cfg[min_lr_ratio]} of the peak, gradient clip {cfg[grad_clip]},
{cfg[batch_size]} random windows of {cfg[context]} tokens per step, seed
{cfg[seed]}; float32 on the CPU ({machine}).

| | |
| --- | --- |
| steps | {steps_done} of the {cfg[steps]} planned (stopped by {stopped_by}) |
| tokens seen | {tokens_seen:.2f} M |
| wall time of the optimizer loop | {minutes:.1f} min ({cfg[minutes]:g} min budget) |
| throughput | {rate:.0f} tokens/s |
| final train loss (mean of the last 50 steps) | {train_loss:.3f} nats/token |
| held-out loss (every held-out token) | {held_loss:.3f} nats/token |
| held-out perplexity | **{ppl:.2f}** per token |

![loss](loss.png)

`training.json` records the command, the configuration, the split, the loss
at every step, the held-out loss at every evaluation, and the machine.
"""
