"""`hybrid-offload bench e2e` (not implemented yet)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of this benchmark."""


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("hybrid-offload bench e2e: not implemented yet")
