"""The edge commands' logging: `--log-level` onto the "tether" loggers, on stderr.

Contract: `LogConfig` (frozen: `log_level`, one of LEVELS) is the flag's dataclass; `add_log_args(parser, default)`
adds `--log-level` with its choices; `configure(cfg)` sends the records of "tether.*" at that level and above to
stderr, one line each. The client's surfaces say what users need on their own (the link's state changes, one line
each: tether.client.outage); at "debug" the log adds gRPC's own text of every failure behind them.

    configure(build_config(LogConfig, args))
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from tether.shared.cli_support import StderrHandler

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LogConfig:
    log_level: str = "warning"  # the least severe log records written to stderr (debug adds gRPC's text of failures)


def add_log_args(parser: argparse.ArgumentParser, default: str = LogConfig.log_level) -> None:
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        default=default,
        help="the least severe log records written to stderr; debug adds gRPC's own text of each "
        "failure (default: %(default)s)",
    )


def configure(cfg: LogConfig) -> None:
    """The "tether" loggers at `cfg.log_level`, to stderr (replacing the handler an earlier call set)."""
    if cfg.log_level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {cfg.log_level!r}")
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    tether = logging.getLogger("tether")
    tether.handlers[:] = [h for h in tether.handlers if not isinstance(h, StderrHandler)] + [handler]
    tether.setLevel(cfg.log_level.upper())
