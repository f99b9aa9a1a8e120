"""The ``pdserve`` command line.

    pdserve generate --model builtin:tiny --prompt "Hello" --max-tokens 16
    pdserve serve --config deploy/configs/local.yaml
    pdserve status | pdserve scale --region east --prefill 1 --decode 2
    pdserve submit --address http://HEAD:8265 --config cluster.yaml
    pdserve demo [--once]
    pdserve bench offline --model builtin:small
    pdserve profile --model builtin:tiny --out profile.json
    pdserve sim --config cluster.yaml --profile profile.json --rate 2 4
    pdserve plan --model llama-7b --device h100 --rate east=20

Errors a user can cause (a bad flag value, a missing model) print one line
naming the field and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.cli import named_kind
from pdserve.core.errors import InvalidArgumentError, PdserveError
from pdserve.core.options import options_from

if TYPE_CHECKING:
    from pdserve.core.sampling_params import SamplingParams

logger = logging.getLogger("pdserve")


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags of ``pdserve generate`` (:func:`_add_engine_flags`, less ``--model``)."""

    dtype: str = "auto"  # auto, float32, bfloat16 or float16
    device: str = "auto"  # auto, cpu or cuda
    quantization: str = "none"  # none, int8 or int4 (weight-only)
    load_format: str = "safetensors"  # or dummy: random weights from config.json
    max_model_len: int | None = None  # longest sequence (None: the model's)
    block_size: int = 16  # KV block size, tokens
    num_blocks: int | None = None  # KV blocks (None: by memory)
    max_num_seqs: int = 64  # running sequences
    max_num_batched_tokens: int = 1024  # tokens of a step
    no_prefix_caching: bool = False  # prefix caching off
    eviction: str = "lru"  # device KV pool: lru, idle or priority
    host_tier_bytes: int = 0  # host KV tier per rank (0: off)
    disk_tier_bytes: int = 0  # disk KV tier per rank (0: off)
    disk_tier_path: str | None = None  # folder of the disk KV tier
    attention_backend: str = "auto"  # the attention backend's name
    tensor_parallel_size: int = 1  # tensor-parallel ranks
    pipeline_parallel_size: int = 1  # pipeline stages
    expert_parallel_size: int = 1  # expert-parallel ranks
    speculative_method: str = "none"  # none, ngram or draft
    speculative_draft_model: str | None = None  # the draft model of method draft
    num_speculative_tokens: int = 4  # drafts per step
    lora: list[str] = field(default_factory=list)  # LoRA adapters, name=folder
    max_lora_rank: int = 64  # highest LoRA rank served


@dataclass(frozen=True)
class SamplingFlags:
    """The sampling flags of ``pdserve generate`` (:func:`_add_sampling_flags`)."""

    max_tokens: int = 32  # tokens generated per prompt
    temperature: float = 0.0  # 0: greedy
    top_k: int = -1  # -1: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # seeds sampling (None: unseeded)
    stop: list[str] = field(default_factory=list)  # stop strings
    ignore_eos: bool = False  # generate past the end-of-sequence token
    presence_penalty: float = 0.0  # -2 to 2 (OpenAI's)
    frequency_penalty: float = 0.0  # -2 to 2 (OpenAI's)
    repetition_penalty: float = 1.0  # (0, 10]; 1: off


@dataclass(frozen=True)
class GenerateOptions:
    """``pdserve generate``'s options."""

    model: str = "builtin:tiny"  # checkpoint folder or builtin:<name>
    engine: EngineFlags = field(default_factory=EngineFlags)  # the engine's flags
    sampling: SamplingFlags = field(default_factory=SamplingFlags)  # the sampling flags
    prompt: list[str] | None = None  # prompt texts (None: "Hello")
    adapter: str | None = None  # the --lora adapter the prompts run under


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="builtin:tiny", help="checkpoint folder or builtin:<name>")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--quantization",
        default="none",
        help="none, int8 (weight-only, per output channel) or int4 (groups of 32)",
    )
    p.add_argument(
        "--load-format",
        default="safetensors",
        choices=["safetensors", "dummy"],
        help="dummy: random weights from config.json alone (for timing a model's shape)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: by memory)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--eviction", default="lru", help="device KV pool: lru, idle or priority")
    p.add_argument("--host-tier-bytes", type=int, default=0, help="host KV tier per rank (0: off)")
    p.add_argument("--disk-tier-bytes", type=int, default=0, help="disk KV tier per rank (0: off)")
    p.add_argument("--disk-tier-path", default=None, help="folder of the disk KV tier")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1)
    p.add_argument("--expert-parallel-size", "--ep", type=int, default=1)
    p.add_argument(
        "--speculative-method",
        default="none",
        help="none, ngram (prompt-lookup drafts) or draft (a draft model's)",
    )
    p.add_argument(
        "--speculative-draft-model",
        default=None,
        help="the draft model (folder or builtin:NAME) of --speculative-method draft",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per step")
    p.add_argument(
        "--lora", action="append", default=[], help="LoRA adapter name=folder (repeatable)"
    )
    p.add_argument("--max-lora-rank", type=int, default=64)


def engine_kwargs(args: EngineFlags) -> dict[str, Any]:
    """The engine flags as keyword arguments of :class:`~pdserve.llm.LLM`."""
    return {
        "dtype": args.dtype,
        "device": args.device,
        "quantization": args.quantization,
        "load_format": args.load_format,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "eviction": args.eviction,
        "host_tier_bytes": args.host_tier_bytes,
        "disk_tier_bytes": args.disk_tier_bytes,
        "disk_tier_path": args.disk_tier_path,
        "attention_backend": args.attention_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "expert_parallel_size": args.expert_parallel_size,
        "speculative_method": args.speculative_method,
        "speculative_draft_model": args.speculative_draft_model,
        "num_speculative_tokens": args.num_speculative_tokens,
        "lora_adapters": args.lora,
        "max_lora_rank": args.max_lora_rank,
    }


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2 (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2 (OpenAI's)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="(0, 10]; 1: off")


def _sampling(args: SamplingFlags) -> SamplingParams:
    from pdserve.core.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    return generate(options_from(GenerateOptions, args))


def generate(args: GenerateOptions) -> int:
    """The prompts generated offline; each output and the speed printed."""
    from pdserve.llm import LLM

    params = _sampling(args.sampling)
    prompts = args.prompt or ["Hello"]
    llm = LLM(args.model, **engine_kwargs(args.engine))
    names = [name for name, _ in llm.config.lora_adapters]
    adapter = args.adapter if args.adapter is not None else (names[0] if len(names) == 1 else None)
    if adapter is not None and adapter not in names:
        raise InvalidArgumentError("--adapter", f"{adapter!r} is not a --lora name ({names})")
    params = dataclasses.replace(params, lora=adapter)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        comp = out.outputs[0]
        generated += len(comp.token_ids)
        print(f"--- prompt: {out.prompt!r}")
        print(f"    output: {comp.text!r}")
        ttft = out.metrics.ttft
        ttft_text = f", ttft: {ttft * 1e3:.1f} ms" if ttft is not None else ""
        print(f"    tokens: {len(comp.token_ids)}, finish: {comp.finish_reason}{ttft_text}")
    print(
        f"{len(outputs)} prompts, {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)"
    )
    return 0


def build_parser(
    command: str | None = "bench", bench_kinds: Collection[str] | None = None
) -> argparse.ArgumentParser:
    """Every command's parser; for a ``command`` other than ``bench``, the benchmarks
    are one line of help: their modules bring torch and Ray, and a command that only
    checks its flags answers without them (a flag error of ``pdserve rollout``: 3.5 s
    with every benchmark imported, 0.7 s without). ``bench_kinds`` names the benchmarks
    whose flags ``bench`` gets (None: all)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline for one or more prompts")
    _add_engine_flags(gen)
    _add_sampling_flags(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument(
        "--adapter",
        default=None,
        help="the --lora adapter the prompts run under (default: the only --lora given, "
        "else the base model)",
    )
    gen.set_defaults(func=cmd_generate)

    from pdserve.bench.cli import BENCH_HELP, add_bench_parser
    from pdserve.deploy import batch_cli, registry_cli, rollout_cli
    from pdserve.deploy.cluster_cli import add_cluster_parsers

    add_cluster_parsers(sub)
    batch_cli.add_parser(sub)
    registry_cli.add_parser(sub)
    rollout_cli.add_parser(sub)
    if command == "bench":
        add_bench_parser(sub, bench_kinds)
    else:
        sub.add_parser("bench", help=BENCH_HELP)
    from pdserve.sim.cli import add_parsers as add_sim_parsers  # profile, sim, plan

    add_sim_parsers(sub)
    _exact_flags(parser)
    return parser


def _exact_flags(parser: argparse.ArgumentParser) -> None:
    """Refuse abbreviated long flags in every command: with them ``pdserve plan --tp 2``
    read as ``--tpot-slo-ms 2``, and a flag added later could change what an old
    command line means."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _exact_flags(child)


def _command(argv: Sequence[str] | None) -> str | None:
    """The command ``argv`` names (None: none yet, as for ``pdserve --help``)."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--log-level")
    first.add_argument("command", nargs="?")
    known, _ = first.parse_known_args(argv)
    return known.command


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = _command(words)
    kind = named_kind(words) if command == "bench" else None
    args = build_parser(command, [kind] if kind else []).parse_args(words)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        _check_out(getattr(args, "out", None))
        return int(args.func(args))
    except PdserveError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file it cannot write or read, a port taken, a peer gone
        logging.getLogger(__name__).debug("pdserve %s failed", args.command, exc_info=True)
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _check_out(out: object) -> None:
    """Refuse a ``--out`` (a file or a folder) that cannot be made, before a run of
    minutes rather than at its end; nothing is made here."""
    if not isinstance(out, str) or not out:
        return
    path = Path(out).absolute()
    if path.exists():
        return  # the command says what it needs there
    ancestor = next(p for p in path.parents if p.exists())
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(20, "not a folder")
        os.rmdir(tempfile.mkdtemp(dir=ancestor))
    except OSError as e:
        raise InvalidArgumentError(
            "--out", f"cannot create {path}: {ancestor}: {e.strerror}"
        ) from None


if __name__ == "__main__":
    sys.exit(main())
