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
    from hybrid_offload.testing.models import build_model
    from hybrid_offload.testing.vision_models import VL_ARCHS, build_vl_model

    if args.arch in VL_ARCHS:
        if args.layers or args.hidden or args.mtp_layers:
            raise SystemExit(f"make-model: --layers, --hidden and --mtp-layers do not apply to {args.arch}")
        out = build_vl_model(args.out, arch=args.arch, seed=args.seed)
    else:
        out = build_model(args.arch, args.out, layers=args.layers, hidden=args.hidden, seed=args.seed,
                          mtp_layers=args.mtp_layers)
    print(out)
    return 0


def _add_make_model(subparsers: Subparsers) -> None:
    from hybrid_offload.testing.models import ARCHS, DEFAULT_ARCH
    from hybrid_offload.testing.vision_models import VL_ARCHS

    p = subparsers.add_parser(
        "make-model",
        help="write a tiny random-weight HF model that vLLM loads offline",
        description="Write config.json, bf16 safetensors and a local tokenizer to --out. "
        "Same arguments give byte-identical files.",
    )
    p.add_argument(
        "--arch",
        choices=ARCHS + VL_ARCHS,
        default=DEFAULT_ARCH,
        help=f"model architecture (default: {DEFAULT_ARCH}; qwen3_5_vl, lfm2_vl: with a vision tower)",
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
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="multi-token-prediction drafter layers (qwen3_next; for speculative decoding "
                   "with method qwen3_next_mtp; default: 0)")
    p.set_defaults(handler=cmd_make_model)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the end-to-end demo and print its summary; exit 1 if float32 outputs differ."""
    from hybrid_offload.testing.models import BF16_ONLY_ARCHS
    from hybrid_offload.tools.demo import DemoOptions, format_summary, run_demo

    dtype = args.dtype or ("bfloat16" if args.arch in BF16_ONLY_ARCHS else "float32")
    summary = run_demo(DemoOptions(arch=args.arch, workdir=args.workdir, dtype=dtype))
    print(format_summary(summary))
    return 0 if summary["outputs_identical"] or dtype != "float32" else 1


def _add_demo(subparsers: Subparsers) -> None:
    from hybrid_offload.testing.models import ARCHS
    from hybrid_offload.tools.demo import DEFAULT_DEMO_ARCH

    p = subparsers.add_parser(
        "demo",
        help="run a hybrid model with the cache on chat, documents and repeated prompts",
        description="Builds a small model, runs a chat, documents with questions and prompts asked "
        "twice through vLLM with a cpu+disk cache, restarts it, and prints the share of the "
        "reusable prefix served, TTFT and whether outputs equal an engine without the cache.",
    )
    p.add_argument("--arch", choices=ARCHS, default=DEFAULT_DEMO_ARCH,
                   help=f"model architecture (default: {DEFAULT_DEMO_ARCH}, in float32)")
    p.add_argument("--workdir", type=Path, default=Path("demo-output"))
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="model dtype (default: bfloat16 for the Qwen GDN models, whose CPU kernels need it, "
                   "float32 otherwise); exit 1 if float32 outputs differ from the baseline")
    p.set_defaults(handler=cmd_demo)


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"want HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _parse_address(text: str) -> str:
    if not _parse_listen(text)[1]:
        raise argparse.ArgumentTypeError(f"want HOST:PORT with a port, got {text!r}")
    return text


def cmd_peer(args: argparse.Namespace) -> int:
    """Run a nixl_peer cache peer until SIGTERM/SIGINT; prints a ready line once it serves.
    Bad options (a literal --token, off-loopback without a token, ...) raise ValueError."""
    from hybrid_offload.backends.nixl_peer.server import PeerOptions, run_peer
    from hybrid_offload.core.secrets import SecretError, create_secret_file, read_secret

    if args.token is not None:
        raise SecretError(
            "--token: a literal token is refused (it would be visible to every local user in ps); "
            "give --token-file PATH (a file holding it) or --token-env VAR (an environment variable)"
        )
    what = "--token-file" if args.token_file is not None else "--token-env"
    if args.token_file is not None and create_secret_file(args.token_file):
        logging.getLogger(__name__).warning(
            "created a new peer token in %s (mode 0600): clients need the same file as token_file",
            args.token_file,
        )
    token = read_secret(file=args.token_file, env=args.token_env, what=what)
    host, port = args.listen
    options = PeerOptions(
        host=host,
        port=port,
        capacity_bytes=args.capacity_bytes,
        token=token,
        insecure=args.insecure,
        pool_bytes=args.pool_bytes,
        lease_timeout_s=args.lease_timeout_s,
        progress_delay_us=args.progress_delay_us,
        alloc_timeout_s=args.alloc_timeout_s,
        max_connections=args.max_connections,
        max_unauthenticated=args.max_unauthenticated,
        handshake_timeout_s=args.handshake_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        max_pending_per_connection=args.max_pending_per_connection,
        advertise=tuple(args.advertise),
    )
    return run_peer(options)


def _byte_size(text: str) -> int:
    """argparse type: a byte count like ``1073741824`` or ``16GiB``."""
    from hybrid_offload.connector.config import ConfigError, parse_size

    try:
        return parse_size(int(text) if text.isdigit() else text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_peer(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "peer",
        help="run a cache peer for the nixl_peer backend",
        description="Hold pages in one NIXL-registered memory pool (LRU, bounded by "
        "--capacity-bytes); clients move page bytes with NIXL READ/WRITE and talk to the peer "
        "over a small TCP control protocol. Prints 'hybrid-offload peer listening on HOST:PORT' "
        "once it serves; SIGTERM/SIGINT stop it.",
    )
    p.add_argument("--listen", type=_parse_listen, required=True, help="HOST:PORT (port 0: any free port)")
    p.add_argument(
        "--advertise", type=_parse_address, action="append", default=[], metavar="HOST:PORT",
        help="an address clients dial this peer by, besides its own port at the address a connection "
        "arrives on (NAT, port forwards, load balancers; repeatable). Clients prove in the handshake "
        "which address they dialed: a peer answers only to its own",
    )
    p.add_argument(
        "--capacity-bytes", type=_byte_size, required=True, help="page bytes held at most, e.g. 16GiB (LRU)"
    )
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--token-file", metavar="PATH", help="file holding the token clients must present")
    secret.add_argument("--token-env", metavar="VAR", help="environment variable holding the token")
    secret.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: visible in ps
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve without a token (anyone who can connect reads and writes every page): only for a "
        "host and network where every user is trusted",
    )
    p.add_argument(
        "--pool-bytes",
        type=_byte_size,
        default=None,
        help="registered pool size (default: capacity + max(25%%, 64 MiB) of slack; uncommitted "
        "ALLOCs beyond the slack are refused rather than evict committed pages)",
    )
    p.add_argument("--lease-timeout-s", type=float, default=30.0, help="GET pins expire after this")
    p.add_argument(
        "--alloc-timeout-s", type=float, default=30.0, help="uncommitted ALLOCs are reclaimed after this"
    )
    p.add_argument(
        "--progress-delay-us",
        type=int,
        default=100,
        help="NIXL progress thread sleep between polls (0: spin a whole core; default 100)",
    )
    limits = p.add_argument_group("limits on clients")
    limits.add_argument(
        "--max-connections", type=int, default=1000, help="open connections at most (default 1000)"
    )
    limits.add_argument(
        "--max-unauthenticated",
        type=int,
        default=64,
        help="connections without HELLO at most; a newer one pushes out the oldest (default 64)",
    )
    limits.add_argument(
        "--handshake-timeout-s",
        type=float,
        default=10.0,
        help="close a connection without HELLO after this (default 10)",
    )
    limits.add_argument(
        "--idle-timeout-s",
        type=float,
        default=600.0,
        help="close a connection without requests after this (default 600)",
    )
    limits.add_argument(
        "--max-pending-per-connection",
        type=int,
        default=64,
        help="open leases, and open reservations, per connection at most (default 64)",
    )
    p.set_defaults(handler=cmd_peer)


def _add_serve(subparsers: Subparsers) -> None:
    from hybrid_offload.tools.cli.serve import add_serve

    add_serve(subparsers)


def _add_bench(subparsers: Subparsers) -> None:
    from hybrid_offload.tools.cli.bench import add_bench

    add_bench(subparsers)


def _add_cache(subparsers: Subparsers) -> None:
    from hybrid_offload.tools.cli.cache import add_cache

    add_cache(subparsers)


_SUBCOMMANDS: list[Callable[[Subparsers], None]] = [
    _add_make_model,
    _add_demo,
    _add_peer,
    _add_serve,
    _add_bench,
    _add_cache,
]


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
