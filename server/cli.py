"""`tether-server`: the GPU end of tether. Subcommands map one-to-one onto frozen config dataclasses.

tether-server build-corpus --out data/corpus            # stdlib sources -> tokenizer + token files
tether-server build-corpus --tokenizer MODEL_DIR --out data/corpus-hf   # token files in a Hugging Face model's ids
tether-server build-corpus --packages --licences-report licences.json --out data/corpus-pkgs  # + permissive packages
tether-server train-target --preset small --out runs/target --steps 4000 --device cuda
tether-server train-target --preset medium --out runs/medium --steps 2000 --device cuda --time-limit-s 480  # chunk
tether-server train-drafter --target MODEL_DIR --data data/corpus-hf --out runs/drafter --device cuda
tether-server generate --prompt "def fib(n):"           # speculative decoding with the default models
tether-server serve --port 50051                        # the gRPC server (SIGTERM stops it gracefully)
tether-server serve --model MODEL_DIR --drafter none --http-port 8000   # any Llama / Qwen2 checkpoint, no drafter
tether-server warm --cache-dir /var/cache/tether        # compile + tune serve's kernels into a cache dir, exit
tether-server quantize --model MODEL_DIR --out DIR --storage int8 --max-shard-mb 10   # int8 rows, 10 MB shards
tether-server <command> --help
tether-server --version

Every flag can also come from a TETHER_* environment variable, --foo-bar from TETHER_FOO_BAR (one variable per
flag name: TETHER_DEVICE is the --device of every command that has one); the command line wins. A variable is read
as the flag's value (a switch: 1/0, true/false, yes/no; a list: values separated by spaces); an empty one counts
as unset. Each command's --help lists its flags' defaults, choices and variables. An invalid flag or variable, or
an error a user can act on (a missing file, a bad value, a port in use, --device cuda on a machine without CUDA),
ends the command with one line on stderr and status 2. A bad model directory (--model, --drafter, train-drafter's
--target: missing, empty, incomplete, or a hub id that was never downloaded) is reported before torch is imported.
`generate` reports time to first token from this process's start and from the models being ready.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the command's start, before the imports: what a user waits from (time to first token)

import argparse  # noqa: E402  (after STARTED, on purpose)
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Protocol, TypeVar  # noqa: E402

# Only light modules here: each subcommand's flags are built when it is parsed (LazyParser), so `--help` and
# `--version` import no torch. The training commands are tether.server.train's (light to import, like this).
from tether.server.train.commands import COMMANDS as TRAINING_COMMANDS  # noqa: E402
from tether.shared.cli_support import (  # noqa: E402
    DRAFTER_FILES,
    TARGET_FILES,
    CommandError,
    EnvParser,
    HelpFormatter,
    LazyParser,
    add_dataclass_args,
    add_version_flag,
    build_config,
    check_model_dir,
    run_cli,
)
from tether.shared.model_source import resolve_model_dir  # noqa: E402


class ModelFlags(Protocol):
    """What serve's, warm's and generate's configs share: the flags that name the models."""

    @property
    def model(self) -> str: ...

    @property
    def revision(self) -> str: ...

    @property
    def drafter(self) -> str: ...


ConfigWithModels = TypeVar("ConfigWithModels", bound=ModelFlags)


def local_models(cfg: ConfigWithModels) -> tuple[ConfigWithModels, str | None]:
    """`cfg` with --model (at --revision) and --drafter as local folders, a hub id replaced by its cached snapshot
    (tether.shared.model_source), and the hub id --model was given as (None for a folder)."""
    model = resolve_model_dir("--model", cfg.model, TARGET_FILES, cfg.revision)
    drafter = cfg.drafter if cfg.drafter == "none" else resolve_model_dir("--drafter", cfg.drafter, DRAFTER_FILES).path
    return dataclasses.replace(cfg, model=str(model.path), drafter=str(drafter)), model.hub_id


def cmd_serve(args: argparse.Namespace) -> int:
    from tether.server.daemon import serve
    from tether.server.serve_config import ServeConfig

    cfg, hub_id = local_models(build_config(ServeConfig, args))
    return serve(dataclasses.replace(cfg, served_model_name=cfg.served_model_name or hub_id or ""))


def cmd_warm(args: argparse.Namespace) -> int:
    from tether.server.daemon import warm
    from tether.server.serve_config import ServeConfig

    return warm(local_models(build_config(ServeConfig, args))[0])  # the flags warm does not take keep serve's defaults


def cmd_generate(args: argparse.Namespace) -> int:
    from tether.server.generate import GenerateConfig, generate_text
    from tether.server.logs import configure_logging
    from tether.shared.logits_processing import ControlError

    cfg, _ = local_models(build_config(GenerateConfig, args))
    configure_logging("text", "warning")  # the engine's start-up lines are serve's to log; here only the text shows

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:  # a control out of its range (or a logit_bias id outside the vocabulary) is refused before the prompt shows
        if args.json:
            print(json.dumps(generate_text(cfg, started=STARTED)))
            return 0
        result = generate_text(cfg, show, on_start=lambda: show(cfg.prompt), started=STARTED)  # the prompt echoed
    except ControlError as e:
        print(f"tether-server generate: error: --{e.control.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    how = f"{result['drafter']} drafter, tau {result['tau']}" if result["drafter"] else "plain decoding"
    first = ""
    if result["ttft_s"] is not None:
        first = (
            f", first token {1000 * result['ttft_s']:.0f} ms after the models were ready, "
            f"{result['ttft_from_start_s']:.2f} s from the start"
        )
    print(f"\n[{result['new_tokens']} tokens, {result['tokens_per_s']} tok/s{first}, {how}]", file=sys.stderr)
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    from tether.server.serve_config import CHOICES, TYPES, ServeConfig

    add_dataclass_args(p, ServeConfig, choices=CHOICES, types=TYPES)


def _warm_args(p: argparse.ArgumentParser) -> None:
    from tether.server.serve_config import CHOICES, TYPES, WARM_FIELDS, ServeConfig

    skip = [n for n in ServeConfig.__dataclass_fields__ if n not in WARM_FIELDS]
    add_dataclass_args(p, ServeConfig, skip=skip, choices=CHOICES, types=TYPES)


def _quantize_args(p: argparse.ArgumentParser) -> None:
    from tether.shared.checkpoint import STORAGES, ConvertConfig

    add_dataclass_args(p, ConvertConfig, choices={"storage": STORAGES})


def cmd_quantize(args: argparse.Namespace) -> int:
    from tether.shared.checkpoint import ConvertConfig, convert_checkpoint
    from tether.shared.model import Transformer

    cfg = build_config(ConvertConfig, args)
    convert_checkpoint(Transformer.from_pretrained(cfg.model), cfg)
    print(f"wrote {args.out}")
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    from tether.server.generate import GenerateConfig, logit_bias_pair

    add_dataclass_args(p, GenerateConfig, types={"logit_bias": logit_bias_pair, "stop_token_ids": int})
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, wall_s, ...)")


COMMANDS = (  # name, help, flags, function
    *TRAINING_COMMANDS,
    (
        "serve",
        "serve the target and drafter over gRPC (tether.v1.Tether) and, with --http-port, an OpenAI API",
        _serve_args,
        cmd_serve,
    ),
    ("warm", "load the models, compile and tune serve's kernels into --cache-dir, and exit", _warm_args, cmd_warm),
    ("generate", "generate text in-process with the target model", _generate_args, cmd_generate),
    (
        "quantize",
        "rewrite a target checkpoint as int8 rows (or plain), in shards of at most --max-shard-mb",
        _quantize_args,
        cmd_quantize,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(
        prog="tether-server",
        description="tether's GPU server: trains and runs the MoDA target model that verifies edge drafts.",
        formatter_class=HelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_version_flag(parser, "tether")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=LazyParser)
    for name, help_text, add_arguments, func in COMMANDS:
        sub.add_parser(name, help=help_text, add_arguments=add_arguments).set_defaults(func=func)
    return parser


# The flags of each command that name a model directory, and the files it must hold. train-drafter's --target is
# checked for being there at all: train-drafter looks at its tokenizer before it loads the rest.
MODEL_DIRS = {
    "serve": {"--model": TARGET_FILES, "--drafter": DRAFTER_FILES},
    "warm": {"--model": TARGET_FILES, "--drafter": DRAFTER_FILES},
    "generate": {"--model": TARGET_FILES, "--drafter": DRAFTER_FILES},
    "quantize": {"--model": TARGET_FILES},
    "train-drafter": {"--target": ()},
}


def check_model_dirs(argv: Sequence[str]) -> None:
    """The model directories a command line (or its TETHER_* variables) names, checked before the command's
    flags are built: building them imports torch, seconds on a small machine before a typo would be reported.
    A flag left at its default is checked when it loads (the same words, later); so is an abbreviated one."""
    if not argv or argv[0] not in MODEL_DIRS or {"-h", "--help"} & set(argv):
        return
    dirs = MODEL_DIRS[argv[0]]
    parser = EnvParser(prog=f"tether-server {argv[0]}", add_help=False, allow_abbrev=False)
    for flag in (*dirs, "--revision"):
        parser.add_argument(flag)
    args, _ = parser.parse_known_args(argv[1:])
    for flag, needs in dirs.items():
        path = getattr(args, flag[2:])
        if path is None or (flag == "--drafter" and path == "none"):
            continue
        if argv[0] == "train-drafter":  # it reads --target as a folder
            check_model_dir(flag, path, needs)
        else:
            resolve_model_dir(flag, path, needs, (args.revision or "") if flag == "--model" else "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_model_dirs(argv)
    except CommandError as e:
        print(f"tether-server {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    return run_cli(build_parser(), argv)


def program() -> None:
    """The `tether-server` program (main() is for callers in a Python process). Once serve has returned, everything
    it owns is stopped and saved ("stopped" is printed), and the process leaves without tearing the interpreter
    down: native threads (gRPC's, ONNX Runtime's, torch's) destroyed under a finalising interpreter can abort a
    cleanly stopped server ("terminate called without an active exception", status -6), as the front ends found.
    The other commands exit as usual."""
    status = main()
    if sys.argv[1:2] == ["serve"]:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    program()
