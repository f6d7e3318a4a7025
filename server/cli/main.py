"""`fdserve`: serve, client-config, --version; other modules add their own subcommands.

A subcommand is one function taking the parsed arguments and returning an exit code, plus
(optionally) a function that declares its arguments:

    @subcommand("bench", "measure decode latency and throughput", add_config_arguments)
    def bench(args: argparse.Namespace) -> int: ...

Subcommands that live outside this file are listed in `EXTENSIONS` (module names); importing
the module registers them. Keep those modules light at import time: `fdserve --help` imports them.
`add_config_arguments` / `config_from_args` give any subcommand the config file and the
override flags that `serve` has.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ConfigError, FdserveConfig, find_default_config, load_config, parse_overrides
from server import __version__

if TYPE_CHECKING:  # the server's modules load only when `serve` runs
    from server.core.state import EngineFactory, ServerState

Run = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]

EXTENSIONS: list[str] = ["server.cli.calibrate", "bench.cli"]  # modules that register more subcommands


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Configure | None
    run: Run


SUBCOMMANDS: dict[str, Subcommand] = {}


def subcommand(name: str, help: str, configure: Configure | None = None) -> Callable[[Run], Run]:
    def register(run: Run) -> Run:
        SUBCOMMANDS[name] = Subcommand(name, help, configure, run)
        return run
    return register


# ----- config flags shared by subcommands ------------------------------------------------------
_FLAG_KEYS = {"host": "server.host", "port": "server.port", "model": "model.name",
              "served_model_name": "model.served_model_name", "api_key": "api.api_key",
              "max_context_len": "model.max_context_len",
              # serve's multi-node flags (other subcommands do not declare them)
              "nnodes": "distributed.nnodes", "node_rank": "distributed.node_rank",
              "master_addr": "distributed.master_addr", "master_port": "distributed.master_port"}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="config.toml (default: $FDSERVE_CONFIG, else ./config.toml if present)")
    parser.add_argument("--host", help="[server] host")
    parser.add_argument("--port", type=int, help="[server] port")
    parser.add_argument("--model", help="[model] name: a local HF folder, a .gguf file, or unset for the default")
    parser.add_argument("--served-model-name", help="[model] served_model_name: the id clients send")
    parser.add_argument("--api-key", help="[api] api_key (prefer ${ENV} in the config file)")
    parser.add_argument("--max-context-len", type=int, help="[model] max_context_len")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="any config key, e.g. --set flashdecoding.kernel=ffd (repeatable; "
                             "values are read as TOML, else as a string)")


def config_from_args(args: argparse.Namespace) -> FdserveConfig:
    overrides = parse_overrides(getattr(args, "set", []) or [])
    for flag, key in _FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    path = args.config if getattr(args, "config", None) else find_default_config()
    return load_config(path, overrides)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ----- serve -----------------------------------------------------------------------------------
def _configure_serve(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    group = parser.add_argument_group("tensor parallelism over several machines ([distributed])")
    group.add_argument("--nnodes", type=int, help="machines the tensor_parallel_size ranks are spread over")
    group.add_argument("--node-rank", type=int, help="this machine's index; node 0 serves HTTP, the others "
                       "only run their ranks")
    group.add_argument("--master-addr", help="address of node 0, reachable from every node")
    group.add_argument("--master-port", type=int, help="rendezvous port on node 0 (the same on every node)")


# After the engine fails, the process is gone within this many seconds even if a client keeps a
# response open: a supervisor restarts it, and a server that lives on without serving helps nobody.
FAILURE_EXIT_DEADLINE_S = 30.0


@subcommand("serve", "start the OpenAI-compatible server", _configure_serve)
def serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    setup_logging(config.server.log_level)
    if config.distributed.node_rank > 0:   # this machine runs its ranks; node 0 serves
        from engine.parallel.rank import serve_node
        return serve_node(config)
    return run_server(config)


def run_server(config: FdserveConfig, engine_factory: EngineFactory | None = None) -> int:
    """Serve until SIGTERM / SIGINT (0) or a failure: the model not loading (1), the engine
    stopping while serving (3). `engine_factory` builds the engine (default: AsyncEngine)."""
    import uvicorn

    from server.app.build import build_app
    from server.core.state import default_engine_factory

    app = build_app(config, engine_factory=engine_factory or default_engine_factory)
    state: ServerState = app.state.fdserve
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level=config.server.log_level,
        access_log=False,  # one line per request comes from fdserve.requests instead
        timeout_graceful_shutdown=int(config.server.request_timeout) + 5,
        timeout_keep_alive=30))

    def stop_on_failure() -> None:
        server.should_exit = True   # requests in flight have their errors; uvicorn lets them be sent
        deadline = threading.Timer(FAILURE_EXIT_DEADLINE_S, _exit_now, args=(state.exit_code,))
        deadline.daemon = True
        deadline.start()

    state.on_failure = stop_on_failure
    logging.getLogger("fdserve.server").info(
        "fdserve %s listening on %s:%d (clients: %s); loading the model...", __version__,
        config.server.host, config.server.port, _base_url(config))
    server.run()
    return state.exit_code


def _exit_now(code: int) -> None:
    logging.getLogger("fdserve.server").error("still running %.0fs after the engine failed; exiting with "
                                              "status %d", FAILURE_EXIT_DEADLINE_S, code)
    logging.shutdown()
    os._exit(code)


def _base_url(config: FdserveConfig) -> str:
    from server.core.state import public_base_url

    return public_base_url(config)


# ----- client-config ---------------------------------------------------------------------------
def _configure_client_config(parser: argparse.ArgumentParser) -> None:
    from server.cli.client_config import RENDERERS

    parser.add_argument("client", choices=sorted(RENDERERS), help="which client to print settings for")
    add_config_arguments(parser)


@subcommand("client-config", "print client settings (base URL, key, model id, context window)",
            _configure_client_config)
def client_config(args: argparse.Namespace) -> int:
    from server.cli.client_config import RENDERERS, client_settings

    settings = client_settings(config_from_args(args))
    sys.stdout.write(RENDERERS[args.client](settings))
    return 0


# ----- tune (engine/tools/tune.py) --------------------------------------------------------------------
def _configure_tune(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    importlib.import_module("engine.tools.tune").add_arguments(parser)


@subcommand("tune", "time GEMV / flat GEMM / cuBLAS on this GPU; write the matmul crossover table", _configure_tune)
def tune(args: argparse.Namespace) -> int:
    status: int = importlib.import_module("engine.tools.tune").run(config_from_args(args), args)
    return status


# ----- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    for module in EXTENSIONS:
        importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="fdserve", description="OpenAI-compatible LLM server with "
                                     "Flash-Decoding, FlashDecoding++ and FFD decode kernels")
    parser.add_argument("--version", action="version", version=f"fdserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for sub in SUBCOMMANDS.values():
        sub_parser = commands.add_parser(sub.name, help=sub.help, description=sub.help)
        if sub.configure is not None:
            sub.configure(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return SUBCOMMANDS[args.command].run(args)
    except ConfigError as exc:
        print(f"fdserve {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m server.cli.main`: run the imported module's main, whose SUBCOMMANDS the extensions
    # register into (this __main__ copy of the module has a registry of its own)
    from server.cli.main import main as registered_main
    sys.exit(registered_main())
