"""``pdserve registry``: push, list and verify immutable model versions (core/registry.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.core import registry


def cmd_push(args: argparse.Namespace) -> int:
    manifest = registry.push(args.name, args.version, Path(args.path))
    print(
        f"{args.name}@{args.version} sha256:{manifest['sha256']} ({len(manifest['files'])} files)"
    )
    print(f"serve it as model: registry:{args.name}@{args.version}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """The versions; a broken manifest is named on stderr, and the exit status is 1."""
    manifests, broken = registry.versions()
    for m in manifests:
        if args.name in (None, m["name"]):
            print(f"{m['name']}@{m['version']}  sha256:{m['sha256'][:16]}  from {m['source']}")
    for why in broken:
        print(f"pdserve registry list: {why}", file=sys.stderr)
    return 1 if broken else 0


def cmd_verify(args: argparse.Namespace) -> int:
    folder = registry.resolve(args.ref)
    print(f"{args.ref}: every file matches its hash ({folder})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("registry", help="immutable, content-hashed model versions")
    kinds = p.add_subparsers(dest="registry_command", required=True)
    push = kinds.add_parser("push", help="copy a checkpoint folder in as NAME@VERSION")
    push.add_argument("name")
    push.add_argument("version")
    push.add_argument("path", help="checkpoint folder (config.json, safetensors, tokenizer)")
    push.set_defaults(func=cmd_push)
    show = kinds.add_parser("list", help="versions in the registry")
    show.add_argument("name", nargs="?")
    show.set_defaults(func=cmd_list)
    check = kinds.add_parser("verify", help="check a version's files against its hashes")
    check.add_argument("ref", help="registry:NAME@VERSION or NAME@VERSION")
    check.set_defaults(func=cmd_verify)
