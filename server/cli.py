"""`tether-server`: the GPU end of tether. Subcommands map one-to-one onto frozen config dataclasses.

tether-server build-corpus --out data/corpus            # stdlib sources -> tokenizer + token files
tether-server train-target --preset small --out runs/target --steps 4000 --device cuda
tether-server generate --prompt "def fib(n):"           # speculative decoding with the default models
tether-server serve --port 50051                        # the gRPC server (SIGTERM stops it gracefully)
tether-server warm --cache-dir /var/cache/tether        # compile + tune serve's kernels into a cache dir, exit
tether-server <command> --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from tether.shared.cli_support import add_dataclass_args, build_config, parse_overrides, run_cli
from tether.shared.config import PRESETS


def cmd_build_corpus(args: argparse.Namespace) -> int:
    from tether.server.corpus import build_corpus

    manifest = build_corpus(
        args.out,
        extra_files=args.extra_files,
        holdout_fraction=args.holdout_fraction,
        vocab_size=args.vocab_size,
        max_files=args.max_files or None,
    )
    print(json.dumps(dataclasses.asdict(manifest) | {"files": len(manifest.files)}, default=str))
    return 0


def cmd_train_target(args: argparse.Namespace) -> int:
    from tether.server.train_target import TrainConfig, train_target

    cfg = build_config(TrainConfig, args, overrides=parse_overrides(args.set))
    summary = train_target(cfg)
    print(json.dumps(summary))
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from tether.server.train_drafter import DrafterTrainConfig, train_drafter

    summary = train_drafter(build_config(DrafterTrainConfig, args, overrides=parse_overrides(args.set)))
    print(json.dumps(summary))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tether.server.daemon import ServeConfig, serve

    return serve(build_config(ServeConfig, args))


def cmd_warm(args: argparse.Namespace) -> int:
    from tether.server.daemon import ServeConfig, warm

    return warm(build_config(ServeConfig, args))  # the flags warm does not take keep serve's defaults


def cmd_generate(args: argparse.Namespace) -> int:
    from tether.server.generate import GenerateConfig, generate_text

    cfg = build_config(GenerateConfig, args)
    if args.json:
        print(json.dumps(generate_text(cfg)))
        return 0
    sys.stdout.write(cfg.prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate_text(cfg, show)
    how = f"{result['drafter']} drafter, tau {result['tau']}" if result["drafter"] else "plain decoding"
    print(f"\n[{result['new_tokens']} tokens, {result['tokens_per_s']} tok/s, {how}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tether.server.generate import GenerateConfig
    from tether.server.train_target import TrainConfig

    parser = argparse.ArgumentParser(
        prog="tether-server",
        description="tether's GPU server: trains and runs the MoDA target model that verifies edge drafts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("build-corpus", help="build the training corpus: stdlib sources -> tokenizer + token files")
    p.add_argument("--out", default="data/corpus", help="output directory")
    p.add_argument("--extra-files", nargs="*", default=[], help="more text files to add to the corpus")
    p.add_argument("--holdout-fraction", type=float, default=0.02, help="fraction of files held out (by file)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N files (0 = all)")
    p.set_defaults(func=cmd_build_corpus)

    p = sub.add_parser("train-target", help="train a target model from a preset")
    helps = {"preset": f"model preset: {', '.join(PRESETS)}"}
    add_dataclass_args(p, TrainConfig, skip=("overrides", "quiet"), helps=helps)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a ModelConfig field of the preset, e.g. --set moda=false --set n_layers=12",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_target)

    from tether.server.train_drafter import DrafterTrainConfig

    p = sub.add_parser("train-drafter", help="train a MoA or EAGLE drafter against a frozen target")
    add_dataclass_args(p, DrafterTrainConfig, skip=("overrides", "quiet"))
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="override a DrafterConfig field, e.g. --set ffn_dim=768")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_drafter)

    from tether.server.daemon import ServeConfig

    p = sub.add_parser("serve", help="serve the target and drafter over gRPC (tether.v1.Tether)")
    add_dataclass_args(p, ServeConfig)
    p.set_defaults(func=cmd_serve)

    from tether.server.daemon import WARM_FIELDS

    p = sub.add_parser("warm", help="load the models, compile and tune serve's kernels into --cache-dir, and exit")
    add_dataclass_args(p, ServeConfig, skip=[n for n in ServeConfig.__dataclass_fields__ if n not in WARM_FIELDS])
    p.set_defaults(func=cmd_warm)

    p = sub.add_parser("generate", help="generate text in-process with the target model")
    add_dataclass_args(p, GenerateConfig)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, wall_s, ...)")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
