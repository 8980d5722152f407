"""`tether-client`: the edge end of tether.

tether-client generate --server HOST:PORT --prompt TEXT [--policy keep|rewind] [--json]
tether-client generate ... --backend onnx|torch --precision fp32|fp16|int8
tether-client chat --server HOST:PORT    # interactive: each line you type, the model continues
tether-client info                       # what this edge install can run (backends, versions)
tether-client info --model DIR           # a model directory's config and fingerprint (what pairing checks)
tether-client <command> --help
tether-client --version

The drafter runs on onnxruntime by default (`--backend onnx`): the server sends the client part as ONNX graphs,
their weights in `--precision` (fp16 halves and int8 quarters the download; drafting computes in fp32 either way),
and no torch is needed. `--backend torch` drafts with torch from the tensors instead (torch must be installed);
use it too with a server too old to offer the ONNX part.
The API key comes from --api-key, else --api-key-file, else the TETHER_API_KEY environment variable (a key on
the command line is visible to every user of the machine in `ps`). Anything invalid the server sends ends the
command with one line on stderr and exit status 2; a server that refuses the request or cannot be reached,
status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

# Only the standard library and light modules at the top: the session (grpc, numpy, the drafter's runtime) is
# imported inside the commands, and a subcommand's flags are built only when it is parsed (LazyParser), so a bare
# `--help` or `--version` stays fast on an edge box (tests/test_client_install.py checks they import no torch).
from tether.client import env
from tether.shared.cli_support import (
    LazyParser,
    add_dataclass_args,
    add_version_flag,
    build_config,
    field_comments,
    installed_version,
    run_cli,
)


def cmd_info(args: argparse.Namespace) -> int:
    report: dict = {"tether": installed_version("tether"), "python": sys.version.split()[0]}
    for name in ("torch", "onnxruntime", "tokenizers", "grpcio"):
        report[name] = installed_version(name)
    if args.model:
        try:
            from tether.shared.checkpoint import fingerprint
            from tether.shared.model import Transformer
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            raise ValueError("describing a model directory needs torch, which this install leaves out") from None

        model = Transformer.from_pretrained(args.model)
        report["model"] = {
            "path": args.model,
            "fingerprint": fingerprint(args.model),
            "config": model.cfg.to_dict(),
            "params": model.cfg.num_params(),
        }
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def _api_key(args: argparse.Namespace) -> str:
    """--api-key, else the file --api-key-file names, else TETHER_API_KEY ("" when none is given)."""
    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return args.api_key or env.api_key()
    key = Path(args.api_key_file).read_text().strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{args.api_key_file} must hold one API key (no spaces or line breaks)")
    return key


def _config(args: argparse.Namespace):
    from tether.client.session_types import ClientConfig

    return dataclasses.replace(build_config(ClientConfig, args), api_key=_api_key(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from tether.client.live_view import LiveView, PlainStream
    from tether.client.session import EdgeSession, LinkDown, ServerError

    session = EdgeSession(_config(args))
    # A ServerDataError (the server sent something invalid) goes on to run_cli: one line, status 2.
    try:
        session.pair()
        tok = session.models.tokenizer
        live = not args.json and not args.plain and sys.stdout.isatty()
        if live:
            with LiveView(tok, args.prompt) as view:
                session.on_event = view.on_event
                result = session.run(args.prompt)
            view.summary(result)
        else:
            if not args.json:
                session.on_event = PlainStream(tok).on_event
                sys.stdout.write(args.prompt)
            result = session.run(args.prompt)
            if args.json:
                print(json.dumps(result.to_json()))
            else:
                print()
    except (ServerError, LinkDown) as e:
        return _failed("generate", e)
    finally:
        session.close()
    return 0


def _failed(command: str, error: Exception) -> int:
    """A server that refuses (FormatNotOffered included) or cannot be reached: one line on stderr, status 1."""
    print(f"tether-client {command}: {error}", file=sys.stderr)
    return 1


def cmd_chat(args: argparse.Namespace) -> int:
    from tether.client.live_view import PlainStream
    from tether.client.session import EdgeSession, LinkDown, ServerError

    cfg = _config(args)
    transcript = ""
    print("tether chat: type a line and the model continues it; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line:
            break
        transcript += line + "\n"
        session = EdgeSession(cfg)
        try:
            session.pair()
            session.on_event = PlainStream(session.models.tokenizer).on_event
            result = session.run(transcript)
        except (ServerError, LinkDown) as e:
            return _failed("chat", e)
        finally:
            session.close()
        transcript += result.text
        print()
    return 0


API_KEY_FILE_HELP = "a file holding the bearer key (instead of --api-key, which others can read in ps)"


def _session_args(parser: argparse.ArgumentParser) -> None:
    """The flags generate and chat share: one per ClientConfig field (importing its module, not the session's
    runtimes), those of a fixed set of values with their choices and default, and the key file."""
    from tether.client.session_types import CHOICES, ClientConfig

    add_dataclass_args(parser, ClientConfig, skip=tuple(CHOICES))
    helps = field_comments(ClientConfig)
    for name, choices in CHOICES.items():
        parser.add_argument("--" + name, choices=choices, default=getattr(ClientConfig, name),
                            help=f"{helps[name]} (default: %(default)s)")  # fmt: skip
    parser.add_argument("--api-key-file", default="", help=API_KEY_FILE_HELP)


def _generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object at the end: text, token_ids, tags, stats"
    )
    parser.add_argument("--plain", action="store_true", help="stream plain text even on a terminal (no live view)")
    _session_args(parser)


def _info_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model directory to describe")
    parser.add_argument("--json", action="store_true", help="one line of JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether-client",
        description="tether's edge client: drafts with a small MoA drafter, keeps generating when the network drops.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_version_flag(parser, "tether")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=LazyParser)
    info = sub.add_parser(
        "info", help="show what this edge install can run, and a model's fingerprint", add_arguments=_info_args
    )
    info.set_defaults(func=cmd_info)
    generate = sub.add_parser(
        "generate",
        help="generate from a prompt through a tether server, surviving outages",
        add_arguments=_generate_args,
    )
    generate.set_defaults(func=cmd_generate)
    chat = sub.add_parser(
        "chat", help="an interactive session: each line you type, the model continues", add_arguments=_session_args
    )
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
