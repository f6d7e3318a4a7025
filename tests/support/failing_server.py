"""`fdserve serve`'s own run loop with a device error injected on demand, for the exit test:
once the file named by --trigger exists, every forward raises what torch raises after an
illegal memory access. Run as `python -m tests.support.failing_server MODEL_DIR PORT TRIGGER`."""
from __future__ import annotations

import sys
from pathlib import Path

from engine import AsyncEngine
from engine.config import FdserveConfig
from server.cli.main import run_server, setup_logging
from tests.support.server_harness import tiny_config


def failing_engine(trigger: Path):
    def factory(config: FdserveConfig) -> AsyncEngine:
        engine = AsyncEngine(config)
        runner = engine.engine.runner
        execute = runner.execute

        def faulty(seqs, input_ids=None):
            if trigger.exists():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return execute(seqs, input_ids)
        runner.execute = faulty
        return engine
    return factory


def main(model_dir: str, port: str, trigger: str) -> int:
    config = tiny_config(Path(model_dir), **{"server.port": int(port), "server.host": "127.0.0.1",
                                             "server.log_level": "info"})
    setup_logging("info")
    return run_server(config, failing_engine(Path(trigger)))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
