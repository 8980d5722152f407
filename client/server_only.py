"""Generation from a server that runs no drafter: the target decodes alone and streams its tokens (Generate RPC).

A server started with `tether-server serve --drafter none` says `server_only` in its ModelInfo and answers Session,
Resync and FetchWeights with REASON_NO_DRAFTER: there is no client part to draft with, so `tether-client generate`
and `chat` stream from Generate instead, and nothing is drafted on the edge (an outage stops the text, since
there is nothing to draft from). Such a server streams no tokenizer either (the tokenizer travels in the client
part), so the user names the model's tokenizer.json, checked against ModelInfo.tokenizer_sha256.

Contract:
- `ServerOnlySession(stub, metadata, cfg, info, tokenizer, on_event=None, stop_ids=None)`: `run(prompt_ids)` ->
  Result, one Generate call. Its events are EdgeSession's: state CONNECTING -> ONLINE -> DONE, and "tokens" tagged
  verified as they arrive. It ends at `cfg.max_new_tokens`, at the first of `stop_ids` (the tokenizer's
  end-of-text by default; the stream is cancelled there) or at `stop()` (thread-safe; it ends at the next chunk).
  Stats say server_only, with time to first token and tokens/s. A token outside the vocabulary or past the length
  is a ServerDataError; a refusal or a broken link raises ServerError or LinkDown (tether.client.transport). `run`
  may be called again (a chat's next turn: a new Generate over the whole conversation, as no session is held).
- `load_tokenizer(path, info)`: the tokenizer in `path` (a tokenizer.json, or a model directory holding one),
  refused (ValueError, one line) unless its hash is the server's.
- `generate_server_only(cfg, prompt, tokenizer)`: one generation over a channel of its own (bench/link.py's
  baseline).

    session = ServerOnlySession(stub, metadata, cfg, info, load_tokenizer("models/target", info))
    result = session.run(tokenizer.encode("def f(x):"))

Tests: tests/client/test_chat.py and tests/e2e/test_chat_e2e.py (generate and chat against `--drafter none`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

import grpc

from tether.client.errors import Problem, ServerDataError
from tether.client.session_types import ClientConfig, Event, Result, State, Stats
from tether.client.transport import Replicas, rpc_error
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb

MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json larger than this is not one


def load_tokenizer(path: str | Path, info: pb.ModelInfo) -> Tokenizer:
    """The tokenizer in `path` (a file, or a directory with tokenizer.json), if it is the server's."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    if file.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"--tokenizer {file}: larger than {MAX_TOKENIZER_BYTES >> 20} MiB, not a tokenizer")
    try:
        tokenizer = Tokenizer.from_json(file.read_text(encoding="utf-8"))
    except Exception as e:  # the tokenizers library raises its own types on text it cannot read
        raise ValueError(f"--tokenizer {file} does not parse: {str(e)[:200]}") from None
    if tokenizer.sha256 != info.tokenizer_sha256:
        raise ValueError(f"--tokenizer {file} is not the server's tokenizer (its hash differs): give the tokenizer "
                         f"of the model the server runs ({info.model_id or 'see tether-server serve'})")  # fmt: skip
    return tokenizer


class ServerOnlySession:
    """Generate calls on a channel the caller owns; see the module docstring."""

    def __init__(self, stub, metadata: tuple, cfg: ClientConfig, info: pb.ModelInfo, tokenizer: Tokenizer,
                 on_event: Callable[[Event], None] | None = None,
                 stop_ids: Collection[int] | None = None):  # fmt: skip
        self.stub, self.metadata, self.cfg, self.info, self.tokenizer = stub, metadata, cfg, info, tokenizer
        self.on_event = on_event or (lambda e: None)
        eos = tokenizer.eos_id
        self.stop_ids = frozenset(stop_ids if stop_ids is not None else ([] if eos is None else [eos]))
        self.state = State.CONNECTING
        self.stats = Stats(server_only=True)
        self._stop_asked = False  # a plain flag: stop() may run in a signal handler, which must take no lock

    def stop(self) -> None:
        """End the generation at the next chunk (thread-safe)."""
        self._stop_asked = True

    def _set_state(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self.on_event(Event("state", state=state))

    def run(self, prompt: list[int]) -> Result:
        if not prompt:
            raise ValueError("the prompt encodes to no tokens")
        cfg = self.cfg
        self._stop_asked = False
        self.stats = stats = Stats(server_only=True)
        self._set_state(State.CONNECTING)
        sampling = pb.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
        req = pb.OpenSession(prompt=prompt, max_new_tokens=cfg.max_new_tokens, sampling=sampling,
                             model_fingerprint=self.info.model_fingerprint)  # fmt: skip
        stats.bytes_up += 4 * len(prompt)
        t0 = time.monotonic()
        tokens: list[int] = []
        call = self.stub.Generate(req, metadata=self.metadata, timeout=max(60.0, cfg.connect_timeout_s))
        try:
            for msg in call:
                self._set_state(State.ONLINE)
                chunk = list(msg.tokens)
                vocab = self.tokenizer.vocab_size
                if len(tokens) + len(chunk) > cfg.max_new_tokens or not all(0 <= t < vocab for t in chunk):
                    raise ServerDataError(Problem.TOKEN, "Generate streamed a token outside the vocabulary or length")
                stats.bytes_down += 4 * len(chunk)
                end = next((i + 1 for i, t in enumerate(chunk) if t in self.stop_ids), None)
                chunk = chunk[:end]
                tokens += chunk
                stats.token_emitted(len(chunk), t0, time.monotonic())
                self.on_event(Event("tokens", tokens=chunk, tag="verified"))
                if end is not None or len(tokens) >= cfg.max_new_tokens or self._stop_asked:
                    stats.stopped = self._stop_asked and end is None and len(tokens) < cfg.max_new_tokens
                    break
        except grpc.RpcError as e:
            raise rpc_error(e) from None  # LinkDown (nothing to draft from: the text ends here) or ServerError
        finally:
            call.cancel()  # a stop id or stop(): the server ends the generation and frees its KV
        stats.wall_s = time.monotonic() - t0
        self._set_state(State.DONE)
        return Result(list(prompt), tokens, ["verified"] * len(tokens), self.tokenizer.decode(tokens), stats)


def generate_server_only(cfg: ClientConfig, prompt: str, tokenizer: Tokenizer) -> Result:
    """The baseline: the server decodes `prompt` alone and streams its tokens; nothing is drafted on the edge."""
    replicas = Replicas(cfg.server, 0, keepalive_s=cfg.keepalive_s, tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert,
                        tls_key=cfg.tls_key)  # fmt: skip
    metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()
    try:
        stub = replicas.stub
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=cfg.connect_timeout_s)
        return ServerOnlySession(stub, metadata, cfg, info, tokenizer, stop_ids=()).run(tokenizer.encode(prompt))
    finally:
        replicas.close()
