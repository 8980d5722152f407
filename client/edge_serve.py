"""`tether-client serve`: a local OpenAI-compatible endpoint for the apps on this machine, drafting here.

    tether-client serve --listen 127.0.0.1:8080 --server HOST:PORT [--policy keep|rewind] [--max-streams 16]
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'

Any OpenAI client works against it: the openai package with base_url="http://127.0.0.1:8080/v1", chat UIs, agent
frameworks. It serves GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed as
server-sent events or not, with usage, stop, max_tokens, n (up to `--max-n`), temperature, top_p, top_k, min_p,
the penalties, logit_bias, stop_token_ids, ignore_eos, seed and logprobs, as the server's own endpoint
(`tether-server serve --http-port`) does, and the same error shapes and statuses (tether.shared.openai_app).
Logprobs are the server's for the tokens it verified and the drafter's own for those drafted offline, which
each choice names in tether's field (`"drafter_logprobs"`, below). The model's chat template and tokenizer come
from the server when pairing.

Each request is an edge session (tether.client.edge_api): this machine drafts, the tether server verifies. Pairing
happens once, at start (the weights come from the cache when they are there); at most `--max-streams` requests run
at once, each with its own server session, and past that a request gets 429 with Retry-After.

While the link to the server is down, a request that was already answering goes on, drafted here alone. Tokens
made so are marked in tether's one extension of OpenAI's schema, a field of every choice that OpenAI clients
ignore: `"tether": {"offline_tokens": N}`, the tokens behind that choice's text (in a stream: behind that chunk's)
that were drafted offline and not verified. With `--policy keep` (the default) offline text is sent as it is
made and stays. With `--policy rewind` the endpoint sends verified text only: what is drafted offline waits
for the resync, which keeps what the target agrees with (then sent, as verified) and retracts the rest, which was
never sent. Only when a generation ends offline and the link does not come back within `--final-resync-s` is the
held text sent, marked offline. A request that arrives while the server cannot be reached gets 503 with
Retry-After and the code `server_unreachable` (`overloaded` is a server that refuses for load): nothing can be
drafted before the server has verified the prompt. The log on stderr (`--log-level`, info by default) has one line
per change of a session's link state ("session 1f2e3d4c: offline: server unreachable", "... resyncing", "...
online: 40 offline tokens verified") and one when it ends; `--log-level debug` adds gRPC's own text of each failure.

A client that goes away, a stop string or max_tokens ends its generation and closes its server session. The
session flags are those of `tether-client generate` (--backend, --precision, --codec, --k, the timeouts ...);
--max-new-tokens is the most one request may ask for, and each request brings its own sampling. --api-key (or
--api-key-file, or TETHER_API_KEY) is the key for the tether server; --http-api-keys or --http-api-key-file are the
keys this endpoint accepts (Authorization: Bearer KEY; /health stays open): set them before listening anywhere
but on the loopback.

Prints `listening on http://HOST:PORT/v1` once requests are taken (port 0 picks a free one); runs until SIGTERM or
Ctrl-C, then stops taking requests and gives those in flight `--grace-s` seconds. A server that cannot be reached
or refuses at start: one line on stderr, exit status 1; one that sends something invalid: exit status 2.

    python -m tether.client.edge_serve --server HOST:PORT   # the same, before the subcommand is registered
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tether.client import env
from tether.client.logs import LogConfig, add_log_args, configure
from tether.shared.cli_support import add_dataclass_args, build_config, field_comments

# The session flags that mean nothing for an endpoint; a request decides its sampling (SAMPLING_FIELDS) itself.
PER_REQUEST = ("session_file",)
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")


@dataclass(frozen=True)
class ServeConfig:
    listen: str = "127.0.0.1:8080"  # HOST:PORT the OpenAI-compatible endpoint listens on (port 0: any free one)
    max_streams: int = 16  # requests generating at once, each one edge session; past it 429 with Retry-After
    http_api_keys: tuple[str, ...] = ()  # keys the endpoint accepts as Bearer (others can read argv: prefer the file)
    http_api_key_file: str = ""  # a file with the endpoint's keys, one per line ('#' comments); none: no authentication
    served_model_name: str = ""  # the model's name in /v1/models; empty: the server's model id
    grace_s: float = 5.0  # seconds requests in flight get to finish when the endpoint stops
    max_n: int = 8  # choices (n) one request may ask for; each is an edge session of --max-streams


def parse_listen(text: str) -> tuple[str, int]:
    """--listen's HOST:PORT ([::1]:8080 for IPv6); a bare host is refused rather than guessed."""
    m = _ADDRESS.match(text.strip())
    if m is None or not 0 <= int(m.group(2)) < 65536:
        raise ValueError(f"--listen {text!r} is not HOST:PORT (for example 127.0.0.1:8080)")
    return m.group(1).strip("[]"), int(m.group(2))


def read_keys(keys: Sequence[str], path: str) -> frozenset[str]:
    """The endpoint's keys: --http-api-keys and the lines of --http-api-key-file ('#' comments)."""
    found = [k.strip() for k in keys]
    if path:
        lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
        file_keys = [ln for ln in lines if ln and not ln.startswith("#")]
        if not file_keys:
            raise ValueError(f"{path} holds no API keys")
        found += file_keys
    if any(not k or any(c.isspace() for c in k) for k in found):
        raise ValueError("an endpoint API key is empty or holds whitespace")
    return frozenset(found)


def upstream_key(args: argparse.Namespace) -> str:
    """The tether server's key: --api-key, else the file --api-key-file names, else TETHER_API_KEY."""
    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return args.api_key or env.api_key()
    key = Path(args.api_key_file).read_text().strip()
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"{args.api_key_file} must hold one API key (no spaces or line breaks)")
    return key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """serve's flags: the endpoint's (ServeConfig) and the session's (ClientConfig, but for the sampling that each
    request brings), those of a fixed set of values with their choices."""
    from tether.client.session_types import CHOICES, SAMPLING_FIELDS, ClientConfig

    add_dataclass_args(parser, ServeConfig)
    helps = {"max_new_tokens": "the most tokens one request may ask for (its max_tokens)"}
    add_dataclass_args(parser, ClientConfig, skip=(*SAMPLING_FIELDS, *PER_REQUEST, *CHOICES), helps=helps)
    comments = field_comments(ClientConfig)
    for name, choices in CHOICES.items():
        parser.add_argument("--" + name, choices=choices, default=getattr(ClientConfig, name), help=comments[name])
    parser.add_argument("--api-key-file", default="", help="a file holding the tether server's bearer key")
    add_log_args(parser, default="info")  # info: one line per change of a session's link state, and its end


def cmd_serve(args: argparse.Namespace) -> int:
    from tether.client.edge_api import EdgeBackend
    from tether.client.session_types import ClientConfig
    from tether.client.transport import LinkDown, ServerError

    try:  # the HTTP stack, and jinja2 for chat templates (imported at the first chat request otherwise)
        import jinja2  # noqa: F401

        from tether.shared.openai_app import HttpConfig, HttpServer, OpenAIApp
    except ModuleNotFoundError as e:
        return _failed(
            f"the endpoint needs {e.name}, which this install leaves out: pip install starlette uvicorn jinja2"
        )
    cfg = build_config(ServeConfig, args)
    client = dataclasses.replace(build_config(ClientConfig, args), api_key=upstream_key(args))
    host, port = parse_listen(cfg.listen)
    keys = read_keys(cfg.http_api_keys, cfg.http_api_key_file)
    if cfg.max_streams < 1 or cfg.max_n < 1:
        raise ValueError("--max-streams and --max-n must be at least 1")
    configure(build_config(LogConfig, args))
    print(f"connecting to {client.server}", file=sys.stderr, flush=True)
    try:
        backend = EdgeBackend.connect(client, model_id=cfg.served_model_name)
    except (ServerError, LinkDown) as e:
        return _failed(f"{e}")
    except KeyboardInterrupt:  # Ctrl-C while pairing (a first download can take a while): nothing is held yet
        return 130
    print(
        f"paired: model {backend.model_id}, client part {backend.paired.nbytes / 1e6:.1f} MB ({client.backend}"
        f"{', ' + client.precision if client.backend == 'onnx' else ''})",
        file=sys.stderr,
        flush=True,
    )
    http_config = HttpConfig(
        host=host, port=port, api_keys=keys, max_streams=cfg.max_streams, max_n=cfg.max_n, grace_s=cfg.grace_s
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="tether-edge-http")
    thread.start()
    server = HttpServer(OpenAIApp(backend, http_config), http_config)
    try:
        bound = server.start(loop)
    except OSError as e:
        loop.call_soon_threadsafe(loop.stop)
        return _failed(f"cannot listen on {cfg.listen}: {e.strerror or e}")
    if not keys and host not in ("127.0.0.1", "::1", "localhost"):
        print(
            f"warning: listening on {host} without --http-api-keys: anyone who can reach it may use it", file=sys.stderr
        )
    where = f"[{host}]" if ":" in host else host
    print(f"listening on http://{where}:{bound}/v1 (model {backend.model_id}, policy {client.policy})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):  # wakes now and then: a signal another thread receives only sets a flag
        pass
    server.stop()
    backend.stop_all()
    backend.wait_released(cfg.grace_s + client.round_timeout_s)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    return 0


def _failed(message: str) -> int:
    print(f"tether-client serve: {' '.join(message.split())}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tether-client serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except (FileNotFoundError, ValueError) as e:  # as tether-client's run_cli: a bad value, invalid server data
        print(f"tether-client serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
