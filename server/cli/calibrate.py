"""`fdserve calibrate`: registered with the CLI through server/cli/main.py's EXTENSIONS."""
from __future__ import annotations

import argparse
from pathlib import Path

from server.cli.main import add_config_arguments, config_from_args, setup_logging, subcommand


def _configure_calibrate(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--output", type=Path, default=Path("fdserve-calibration.json"),
                        help="where to write the per-layer φ file (then set [flashdecoding] "
                             "calibration_file to it and fixed_max_value = true)")
    parser.add_argument("--text", type=Path, action="append", default=[],
                        help="text file to calibrate on (repeatable; default: standard-library sources)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of each text to prefill")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens to decode after each text")


@subcommand("calibrate", "record the model's softmax-input range per layer and write the FD++ φ file",
            _configure_calibrate)
def calibrate(args: argparse.Namespace) -> int:
    from engine.tools.calibration_run import run_calibration

    config = config_from_args(args)
    setup_logging(config.server.log_level)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in args.text] or None
    result = run_calibration(config, args.output, texts=texts, prompt_tokens=args.prompt_tokens,
                             decode_tokens=args.decode_tokens)
    outside = sum(layer["rows_outside_window"] for layer in result["layers"])
    print(f"wrote {args.output}: φ for {len(result['phi'])} layers "
          f"({outside} of {sum(layer['rows'] for layer in result['layers'])} rows outside the safe window)")
    print(f"use it with: [flashdecoding] async_softmax = true, fixed_max_value = true, "
          f"calibration_file = \"{args.output}\"")
    return 0
