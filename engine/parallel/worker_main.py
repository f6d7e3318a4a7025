"""`python -m engine.parallel.worker_main`: one rank other than 0, started by its node's first process
(engine/parallel/launch.py) with the config as JSON on stdin. Exits 0 when rank 0 says Stop, 1 on any failure."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from engine.config import FdserveConfig

logger = logging.getLogger("fdserve.rank")

PARENT_POLL_S = 1.0


def _exit_with_parent() -> None:
    """Exit once the node's first process is gone, however it went (SIGKILL included). A watch on the
    parent's pid, not PR_SET_PDEATHSIG, which fires when the spawning *thread* ends (a server's loader
    thread ends at shutdown, before the ranks are told to stop)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                logger.error("the node's first process (pid %d) is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="fdserve-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--cpu-threads", type=int, default=None)
    args = parser.parse_args(argv)
    _exit_with_parent()
    # Ctrl-C reaches the whole process group: rank 0 drains and then stops this rank with a message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = FdserveConfig.model_validate_json(sys.stdin.buffer.read())
    logging.basicConfig(level=config.server.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {args.rank} %(name)s: %(message)s")
    try:
        from engine.parallel.rank import serve_rank
        serve_rank(config, args.model_dir, args.rank, args.world_size, args.local_rank, args.cpu_threads)
    except Exception:  # noqa: BLE001 - the exit status and the log are all rank 0's supervisor sees
        logger.exception("rank %d stopped on an error", args.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
