"""`tether-client`: the edge end of tether.

tether-client info                       # what this edge install can run (backends, versions)
tether-client info --model DIR           # a model directory's config and fingerprint (what pairing checks)
tether-client <command> --help
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Sequence

from tether.shared.cli_support import run_cli


def _version(distribution: str) -> str | None:
    """An installed distribution's version; None when it is absent (or, for tether, run from a source tree)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_info(args: argparse.Namespace) -> int:
    report: dict = {"tether": _version("tether"), "python": sys.version.split()[0]}
    for name in ("torch", "onnxruntime", "tokenizers", "grpcio"):
        report[name] = _version(name)
    if args.model:
        from tether.shared.checkpoint import fingerprint
        from tether.shared.model import Transformer

        model = Transformer.from_pretrained(args.model)
        report["model"] = {
            "path": args.model,
            "fingerprint": fingerprint(args.model),
            "config": model.cfg.to_dict(),
            "params": model.cfg.num_params(),
        }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether-client",
        description="tether's edge client: drafts with a small MoA drafter, keeps generating when the network drops.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="show what this edge install can run, and a model's fingerprint")
    p.add_argument("--model", help="a model directory to describe")
    p.add_argument("--json", action="store_true", help="one line of JSON")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
