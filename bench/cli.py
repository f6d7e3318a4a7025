"""Registers `fdserve bench` with the CLI (see server/cli/main.py EXTENSIONS); light at import time."""
from __future__ import annotations

import argparse
import importlib

from server.cli.main import subcommand


def _configure(parser: argparse.ArgumentParser) -> None:
    importlib.import_module("bench.e2e").add_arguments(parser)


@subcommand("bench", "decode latency and throughput, [flashdecoding] off vs on (latency | concurrency | serve)",
            _configure)
def bench(args: argparse.Namespace) -> int:
    from bench.e2e import run
    return run(args)
