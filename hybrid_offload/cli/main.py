"""`hybrid-offload` command line: one argparse subcommand per function.

To add a subcommand, write `_add_<name>(subparsers)` that builds its parser and sets
`handler=<function(args) -> int>`, and append it to `_SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

Subparsers = argparse._SubParsersAction  # the object add_subparsers() returns


def cmd_make_model(args: argparse.Namespace) -> int:
    """Build a random-weight model directory; prints its path on stdout."""
    from hybrid_offload.models import build_model

    out = build_model(args.arch, args.out, layers=args.layers, hidden=args.hidden, seed=args.seed)
    print(out)
    return 0


def _add_make_model(subparsers: Subparsers) -> None:
    from hybrid_offload.models import ARCHS, DEFAULT_ARCH

    p = subparsers.add_parser(
        "make-model",
        help="write a tiny random-weight HF model that vLLM loads offline",
        description="Write config.json, bf16 safetensors and a local tokenizer to --out. "
        "Same arguments give byte-identical files.",
    )
    p.add_argument(
        "--arch",
        choices=ARCHS,
        default=DEFAULT_ARCH,
        help=f"model architecture (default: {DEFAULT_ARCH})",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="number of decoder layers (default: per-arch tiny value)",
    )
    p.add_argument(
        "--hidden", type=int, default=None, help="hidden size, a multiple of 64 (default: 256)"
    )
    p.add_argument("--seed", type=int, default=0, help="weight init seed (default: 0)")
    p.set_defaults(handler=cmd_make_model)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the end-to-end demo and print its summary; exit 1 if outputs differ."""
    from hybrid_offload.demo import DemoOptions, format_summary, run_demo

    summary = run_demo(DemoOptions(arch=args.arch, workdir=args.workdir, max_tokens=args.max_tokens))
    print(format_summary(summary))
    return 0 if summary["outputs_identical"] else 1


def _add_demo(subparsers: Subparsers) -> None:
    from hybrid_offload.models import ARCHS, DEFAULT_ARCH

    p = subparsers.add_parser(
        "demo",
        help="run a hybrid model with the cache: cold, same-session hit, restart hit",
        description="Builds a small model, runs vLLM with a cpu+disk cache, restarts it, and "
        "prints tokens loaded per backend, hit rates, TTFT and whether outputs are identical.",
    )
    p.add_argument("--arch", choices=ARCHS, default=DEFAULT_ARCH)
    p.add_argument("--workdir", type=Path, default=Path("demo-output"))
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(handler=cmd_demo)


_SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_add_make_model, _add_demo]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="hybrid-offload",
        description="External KV cache for hybrid (attention + Mamba/GDN) models in vLLM.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the subcommand, return its exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args))
    except ValueError as exc:
        logger.error("%s: %s", args.command, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
