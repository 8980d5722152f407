"""`tether-client`: the edge end of tether.

tether-client generate --server HOST:PORT --prompt TEXT [--policy keep|rewind] [--json]
tether-client generate --server HOST:PORT --prompt-file PATH       # or --prompt - : the prompt from stdin
tether-client generate ... --backend onnx|torch --precision fp32|fp16|int8
tether-client generate ... --temperature 0.7 --top-k 40 --min-p 0.05 --presence-penalty 0.5 --frequency-penalty 0.3
                           --repetition-penalty 1.1 --logit-bias 13=-100 --logit-bias 7=2.5 --stop-token-ids 2 9
tether-client chat --server HOST:PORT [--system TEXT]               # a conversation in the model's chat template
tether-client serve --listen 127.0.0.1:8080 --server HOST:PORT     # an OpenAI-compatible endpoint on this machine
tether-client info                       # what this edge install can run (backends, versions)
tether-client info --model DIR           # a model directory's config and fingerprint (what pairing checks)
tether-client <command> --help           # every flag with its default and allowed values
tether-client --version

generate prints the text as it comes (a live view on a terminal, plain text in a pipe, or one JSON object with
--json) and ends with a summary: tokens verified and drafted offline, time to first token (from the command's
start, and after pairing: --json's ttft_from_start_s and ttft_s), tokens/s. While the server cannot be reached,
generate and chat say each change of the link's state in one line ("offline: server unreachable", "resyncing",
"online: 40 offline tokens verified"); --log-level debug adds gRPC's own text of each failure on stderr. chat keeps
the conversation as messages rendered with the model's chat template (the server sends it), sends only each
turn's new tokens into one server session, and drafts alone while the server is unreachable; it has line editing
and history on a terminal (--history-file) and reads one message a line from a pipe. Ctrl-C while a reply
streams stops it; Ctrl-C or Ctrl-D at the prompt ends the chat.

Both print "connecting to HOST:PORT" on stderr (not with --json) and a progress bar of the first download of the
client part (on a terminal, or with --progress; nothing when it is cached). An address where no tether server
answers ends them at once with one line saying what does answer there: nothing (connection refused: a server not
up yet is waited for up to --connect-timeout-s), something that is not a gRPC server (a wrong port), a TLS server
dialled in plaintext or the reverse, a certificate that does not verify.

The drafter runs on onnxruntime by default (`--backend onnx`): the server sends the client part as ONNX graphs,
their weights in `--precision` (fp16 halves and int8 quarters the download; int8 also runs its matrix products in int8),
and no torch is needed. `--backend torch` drafts with torch from the tensors instead (torch must be installed);
use it too with a server too old to offer the ONNX part. A server without a drafter (`tether-server serve
--drafter none`) decodes alone and streams its tokens (the summary and --json say server-only); the client fetches
its tokenizer from it once (cached by hash like the client part); --tokenizer PATH gives one instead (it must be
the server's), as a server older than this client sends none.
The sampling controls (their ranges are tether.shared.logits_processing's) go to the server, which verifies by
them, and the drafter proposes from the same rule, offline too; a value out of range is one line and status 2
before anything is dialled, and a server that does not apply them (older than this client) is refused, status 1.
The API key comes from --api-key, else --api-key-file, else the TETHER_API_KEY environment variable (a key on
the command line is visible to every user of the machine in `ps`).
Exit status: 0 done; 1 a server that refuses or cannot be reached (one line on stderr); 2 invalid input, or
anything invalid the server sends (one line); 130 Ctrl-C (what was generated is printed, the server session
closed).
"""

from __future__ import annotations

import time

STARTED_AT = time.monotonic()  # the command's start, as early as this module can take it: time to first token

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

# Only the standard library and light modules at the top: the session (grpc, numpy, the drafter's runtime) is
# imported inside the commands, and a subcommand's flags are built only when it is parsed (LazyParser), so a bare
# `--help` or `--version` stays fast on an edge box (tests/test_client_install.py checks they import no torch).
from tether.client import env  # noqa: E402
from tether.client.logs import LogConfig, add_log_args, configure  # noqa: E402
from tether.shared.cli_support import (  # noqa: E402
    LazyParser,
    add_dataclass_args,
    add_version_flag,
    build_config,
    field_comments,
    installed_version,
    run_cli,
)

INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


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
    key = args.api_key
    # tether.shared.cli_support fills --api-key from TETHER_API_KEY too: a key that only the environment gave
    # yields to the file given on the command line (the command line wins).
    if key and args.api_key_file and key.strip() == env.api_key():
        key = ""
    if key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return key or env.api_key()
    key = Path(args.api_key_file).read_text().strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{args.api_key_file} must hold one API key (no spaces or line breaks)")
    return key


def _config(args: argparse.Namespace):
    from tether.client.session_types import ClientConfig

    return dataclasses.replace(build_config(ClientConfig, args), api_key=_api_key(args))


def _prompt(args: argparse.Namespace) -> str:
    """--prompt TEXT, --prompt - (standard input) or --prompt-file PATH, exactly as given."""
    if args.prompt_file:
        text = Path(args.prompt_file).read_text(encoding="utf-8")
    elif args.prompt == "-":
        text = sys.stdin.read()
    else:
        text = args.prompt
    if not text:
        raise ValueError("the prompt is empty")
    return text


def _failed(command: str, error: Exception) -> int:
    """A server that refuses (FormatNotOffered included) or cannot be reached: one line on stderr, status 1."""
    print(f"tether-client {command}: {' '.join(str(error).split())}", file=sys.stderr)
    return 1


def _connect(args: argparse.Namespace, quiet: bool):
    """The session, paired; or, for a server without a drafter, a ServerOnlySession on its channel. Returns
    (session, engine, tokenizer); the caller closes the session."""
    from rich.console import Console

    from tether.client.live_view import Connecting
    from tether.client.server_only import ServerOnlySession, server_tokenizer
    from tether.client.session import EdgeSession

    configure(build_config(LogConfig, args))
    cfg = _config(args)
    session = EdgeSession(cfg, started_at=STARTED_AT)
    console = Console(stderr=True, highlight=False, quiet=quiet)
    bar = console.is_terminal if args.progress is None else args.progress
    notes = Connecting(console, bar=bar)
    console.print(f"connecting to {session.link.replicas.address}", markup=False)  # [::1]:50051 is no markup
    own, session.on_event = session.on_event, notes.on_event  # while pairing; then the session's own again
    try:
        info = session.model_info()
        if not info.server_only or cfg.mode == "hybrid":  # a hybrid forced on a server-only one: pair() refuses
            session.pair()
            return session, session, session.models.tokenizer
        tokenizer = server_tokenizer(session, args.tokenizer)
        engine = ServerOnlySession(
            session.link.stub, session.link.metadata, cfg, info, tokenizer, started_at=STARTED_AT
        )
        return session, engine, tokenizer
    except BaseException:
        session.close()
        raise
    finally:
        notes.close()
        session.on_event = own


def cmd_generate(args: argparse.Namespace) -> int:
    from tether.client.chat import interruptible
    from tether.client.live_view import LiveView, PlainStream
    from tether.client.transport import LinkDown, ServerError

    prompt = _prompt(args)  # before connecting: a missing file costs no round trip
    try:
        session, engine, tok = _connect(args, quiet=args.json)
    except (ServerError, LinkDown) as e:
        return _failed("generate", e)
    except KeyboardInterrupt:
        return INTERRUPTED
    # A ServerDataError (the server sent something invalid) goes on to run_cli: one line, status 2.
    try:
        prompt_ids = tok.encode(prompt)  # the session takes token ids: the text shown continues these
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        live = not args.json and not args.plain and sys.stdout.isatty()
        shown = {"context": prompt_ids, "hidden": engine.stop_ids or ()}  # the stop ids: known once paired
        if live:
            with LiveView(tok, prompt, **shown) as view:
                engine.on_event = view.on_event
                with interruptible(engine.stop):
                    result = engine.run(prompt_ids)
            view.summary(result)
        else:
            plain = PlainStream(tok, **shown)
            if not args.json:
                engine.on_event = plain.on_event
                sys.stdout.write(prompt)
            with interruptible(engine.stop):
                result = engine.run(prompt_ids)
            if args.json:
                print(json.dumps(result.to_json(result.continuation(tok, engine.stop_ids or ()))))
            else:
                print()
                plain.summary(result)
    except (ServerError, LinkDown) as e:
        return _failed("generate", e)
    except KeyboardInterrupt:  # a second Ctrl-C: no waiting for the step in progress
        print(file=sys.stderr)
        return INTERRUPTED
    finally:
        session.close()
    return INTERRUPTED if result.stats.stopped else 0


def cmd_chat(args: argparse.Namespace) -> int:
    try:
        import jinja2  # noqa: F401  (chat templates render with it; an edge install may leave it out)
    except ModuleNotFoundError:
        raise ValueError("chat renders the model's chat template with jinja2: pip install 'jinja2>=3.1.6'") from None
    from rich.console import Console

    from tether.client.chat import Chat, LineReader, default_history_file, repl
    from tether.client.edge_api import chat_format
    from tether.client.transport import LinkDown, ServerError

    try:
        session, engine, tok = _connect(args, quiet=False)
    except (ServerError, LinkDown) as e:
        return _failed("chat", e)
    except KeyboardInterrupt:
        return INTERRUPTED
    reader = None
    try:
        info = session.model_info()
        fmt = chat_format(info, tok)  # a malformed one: ServerDataError, one line, status 2
        chat = Chat(engine, fmt, args.system)
        interactive = sys.stdin.isatty()
        reader = LineReader(args.history_file or default_history_file(), interactive=interactive)
        if interactive:
            print(
                f"chatting with {info.model_id or 'the model'}: Enter sends, Ctrl-C stops a reply, Ctrl-D or Ctrl-C "
                "here ends",
                file=sys.stderr,
            )
        return repl(chat, reader, out=Console(highlight=False, soft_wrap=True), err=sys.stderr)
    except (ServerError, LinkDown) as e:
        return _failed("chat", e)
    except KeyboardInterrupt:  # a second Ctrl-C while a reply streams
        print(file=sys.stderr)
        return INTERRUPTED
    finally:
        if reader is not None:
            reader.close()
        session.close()


REPEATED = ("logit_bias", "stop_token_ids")  # ClientConfig's list fields, each a repeatable flag


def _bias(item: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS as (id, bias); the ranges are checked with the other controls (ClientConfig.check)."""
    token, sep, bias = item.partition("=")
    try:
        if sep:
            return int(token), float(bias)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {item!r}")


API_KEY_FILE_HELP = "a file holding the bearer key (instead of --api-key, which others can read in ps)"
SKIPPED_IN_CHAT = ("session_file",)  # a session file resumes one generation; a chat is not one


def _session_args(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """The flags generate and chat share: one per ClientConfig field (importing its module, not the session's
    runtimes), those of a fixed set of values with their choices, every one with its default; the key file, the
    tokenizer for a server without a drafter, and the download's progress bar."""
    from tether.client.session_types import CHOICES, ClientConfig

    comments = field_comments(ClientConfig)
    helps = {name: f"{text} (default: %(default)s)" for name, text in comments.items()}
    add_dataclass_args(parser, ClientConfig, skip=(*CHOICES, *REPEATED, *skip), helps=helps)
    for name, choices in CHOICES.items():
        parser.add_argument("--" + name, choices=choices, default=getattr(ClientConfig, name), help=helps[name])
    # Repeatable, each flag one or more items: --logit-bias 13=-100 --logit-bias 7=2.5, --stop-token-ids 2 9
    parser.add_argument(
        "--logit-bias",
        action="extend",
        nargs="+",
        type=_bias,
        default=[],
        metavar="ID=BIAS",
        help=comments["logit_bias"] + " (default: none)",
    )
    parser.add_argument(
        "--stop-token-ids",
        action="extend",
        nargs="+",
        type=int,
        default=[],
        metavar="ID",
        help=comments["stop_token_ids"] + ", repeatable (default: none)",
    )
    parser.add_argument("--api-key-file", default="", help=API_KEY_FILE_HELP)
    parser.add_argument(
        "--tokenizer",
        default="",
        metavar="PATH",
        help="the model's tokenizer.json (or its directory), for a server without a drafter "
        "(default: the server's own, fetched once and cached)",
    )
    add_log_args(parser)
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr while the client part downloads (default: on a terminal)",
    )


def _generate_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to continue; - reads it from standard input")
    source.add_argument("--prompt-file", metavar="PATH", help="a file holding the text to continue (UTF-8)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end: text, token_ids, tags, stats (time to first token, "
        "tokens/s, ...); nothing on stderr but errors",
    )
    parser.add_argument("--plain", action="store_true", help="stream plain text even on a terminal (no live view)")
    _session_args(parser)


def _chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default="", help="a system message to start the conversation with (default: none)")
    parser.add_argument(
        "--history-file",
        default="",
        metavar="PATH",
        help="where the input history is kept (default: $XDG_STATE_HOME/tether/chat_history, or "
        "~/.local/state/tether/chat_history)",
    )
    _session_args(parser, skip=SKIPPED_IN_CHAT)


def _info_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model directory to describe")
    parser.add_argument("--json", action="store_true", help="one line of JSON")


def _serve_args(parser: argparse.ArgumentParser) -> None:
    from tether.client.edge_serve import add_arguments

    add_arguments(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    from tether.client.edge_serve import cmd_serve as serve

    return serve(args)


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
        "chat", help="a conversation in the model's chat template, surviving outages", add_arguments=_chat_args
    )
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser(
        "serve",
        help="a local OpenAI-compatible endpoint, drafting here, verified by the server",
        add_arguments=_serve_args,
    )
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
