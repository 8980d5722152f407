"""Generation from a server that runs no drafter: the target decodes alone and streams its tokens (Generate RPC).

A server started with `tether-server serve --drafter none` says `server_only` in its ModelInfo and answers Session,
Resync and FetchWeights of a drafter's part with REASON_NO_DRAFTER: there is no client part to draft with, so
`tether-client generate` and `chat` stream from Generate instead, and nothing is drafted on the edge (an outage
stops the text, since there is nothing to draft from). The tokenizer that encodes the prompt and decodes the
stream comes from the server (FetchWeights of CLIENT_PART_TOKENIZER, which every server lists in
ModelInfo.client_part_formats, drafter or not) and is cached by its hash; `--tokenizer PATH` overrides it.

Contract:
- `ServerOnlySession(stub, metadata, cfg, info, tokenizer, on_event=None, stop_ids=None, started_at=None)`:
  `run(prompt_ids)` -> Result, one Generate call (`started_at`: the command's start, for ttft_from_start_s), token
  ids in and out as EdgeSession's (the tokenizer gives the vocabulary and the end-of-text ids; its caller decodes).
  Its events are EdgeSession's: state CONNECTING -> ONLINE -> DONE, and "tokens" tagged verified as they arrive. It
  ends at `cfg.max_new_tokens`, at the first of `stop_ids` (by default every end-of-text id of the model and the
  config's stop token ids: tether.client.controls; the stream is cancelled there) or at `stop()` (thread-safe; it
  ends at the next chunk). The config's sampling controls go with the request; a server that does not apply them
  is refused at construction (ControlsNotOffered), as a logit_bias or stop id outside the vocabulary (ControlError).
  Stats say server_only, with time to first token and tokens/s. A token outside the vocabulary or past the length
  is a ServerDataError; a refusal or a broken link raises ServerError or LinkDown (tether.client.transport). The
  call has no deadline as a whole (a long generation streams as long as it takes); a chunk that does not come in
  time is a stalled link, LinkDown(STALLED): the first within `first_chunk_s(cfg)`, each later one within
  `cfg.round_timeout_s`. `run`
  may be called again (a chat's next turn: a new Generate over the whole conversation, as no session is held).
- `fetch_tokenizer(stub, info, cache_dir, *, metadata=(), timeout_s=120.0, on_progress=None,
  max_bytes=DEFAULT_MAX_BYTES)` -> Tokenizer: the one cached under ModelInfo.tokenizer_sha256 (nothing is asked
  of the server then), else streamed. Before a byte is downloaded: info's hash is 64 hex digits, the format is
  offered (FormatNotOffered otherwise: an older server), the manifest is of info's model and drafter, of the
  tokenizer format, and holds one entry, tokenizer.json, uint8 [nbytes], at most MAX_STREAMED_BYTES (32 MiB) and
  `max_bytes`, whose sha256 is info's tokenizer hash. The download resumes from the cache's partial file and is
  checked by sha256 (tether.client.pairing_checks.download, tether.client.weight_cache); the tokenizer must then
  parse and hash to info's. Refusals are ServerDataError (one line; `.problem` MODEL_INFO, FINGERPRINT, MANIFEST,
  WEIGHT_SIZE, TOKENIZER, CACHE_KEY, CHUNK or CHECKSUM); a broken stream raises grpc.RpcError or ConnectionError,
  and calling again resumes.
- `server_tokenizer(session, override="")` -> Tokenizer, what `tether-client` decodes a server-only stream with:
  `override` (--tokenizer) through load_tokenizer, else fetch_tokenizer over the session's link, its download
  retried with the session's backoff like the client part's and reported as "download" events (`session`: an
  EdgeSession, or anything `Connected`).
- `load_tokenizer(path, info)`: the tokenizer in `path` (a tokenizer.json, or a model directory holding one),
  refused (ValueError, one line) unless its hash is the server's.

    tokenizer = fetch_tokenizer(stub, info, "~/.cache/tether")
    session = ServerOnlySession(stub, metadata, cfg, info, tokenizer)
    result = session.run(tokenizer.encode("def f(x):"))

Tests: tests/client/test_tokenizer_fetch.py (the tokenizer from a server without a drafter: greedy text equal to
the server's own, cached, resumed, hostile manifests and bytes), tests/client/test_chat.py and
tests/e2e/test_chat_e2e.py (generate and chat against `--drafter none`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from tether.client.controls import check_controls, sampling_params
from tether.client.controls import stop_ids as controls_stop_ids
from tether.client.errors import Problem, ServerDataError
from tether.client.generation_stream import GenerationStream
from tether.client.pairing_checks import (
    DEFAULT_MAX_BYTES,
    MAX_FINGERPRINT_CHARS,
    PairingError,
    check_tokenizer,
    download,
    manifest_entries,
    request_manifest,
    served_tokenizer,
)
from tether.client.pairing_checks import MAX_TOKENIZER_BYTES as MAX_STREAMED_BYTES
from tether.client.server_link import ServerLink
from tether.client.session_types import ClientConfig, Event, Result, State, Stats
from tether.client.transport import DOWNLOAD_ATTEMPTS, Backoff, FormatNotOffered
from tether.client.weight_cache import WeightCache, is_sha256
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import TOKENIZER_TENSOR
from tether.v1 import tether_pb2 as pb

MAX_TOKENIZER_BYTES = 64 << 20  # a tokenizer.json file larger than this is not one


class Connected(Protocol):
    """What server_tokenizer needs of a session (tether.client.session.EdgeSession): its config, its link to the
    server, its retry policy and where its events go."""

    cfg: ClientConfig
    link: ServerLink
    backoff: Backoff
    on_event: Callable[[Event], None]

    def model_info(self) -> pb.ModelInfo: ...


def fetch_tokenizer(
    stub,
    info: pb.ModelInfo,
    cache_dir: str | Path,
    *,
    metadata: tuple = (),
    timeout_s: float = 120.0,
    on_progress: Callable[[int, int], None] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tokenizer:
    """The server's tokenizer, from the cache or streamed; see the module docstring."""
    if not is_sha256(info.tokenizer_sha256):
        raise ServerDataError(
            Problem.CACHE_KEY, f"tokenizer_sha256 {info.tokenizer_sha256[:80]!r} is not 64 lowercase hex digits"
        )
    if not 0 < len(info.model_fingerprint) <= MAX_FINGERPRINT_CHARS:
        raise ServerDataError(
            Problem.MODEL_INFO, f"model_fingerprint must hold 1 to {MAX_FINGERPRINT_CHARS} characters"
        )
    cache = WeightCache(Path(cache_dir).expanduser())
    held = cache.find(info.tokenizer_sha256)
    if held is not None:  # verified when it was written; check_tokenizer hashes it again
        return check_tokenizer(held.read_bytes(), info)
    if pb.CLIENT_PART_TOKENIZER not in info.client_part_formats:
        raise FormatNotOffered(
            "the server does not stream its tokenizer (a server older than this client): give "
            "the model's with --tokenizer PATH (its tokenizer.json or directory)"
        )
    req, man = request_manifest(stub, info, pb.CLIENT_PART_TOKENIZER, metadata=metadata, timeout_s=timeout_s)
    entries = manifest_entries(man)
    if [e.name for e in entries] != [TOKENIZER_TENSOR]:
        raise PairingError(
            Problem.MANIFEST, f"the tokenizer part must hold {TOKENIZER_TENSOR} alone, not {len(entries)} entries"
        )
    entry = entries[0]
    if entry.dtype != "uint8" or entry.shape != (entry.nbytes,) or entry.nbytes < 1:
        raise PairingError(
            Problem.MANIFEST,
            f"{TOKENIZER_TENSOR} must be uint8 bytes, not {entry.dtype[:40]!r} "
            f"{list(entry.shape)[:4]} of {entry.nbytes} bytes",
        )
    limit = min(MAX_STREAMED_BYTES, max_bytes)
    if entry.nbytes > limit:
        raise PairingError(
            Problem.WEIGHT_SIZE, f"the tokenizer is {entry.nbytes} bytes, over the client's limit of {limit}"
        )
    if entry.sha256 != info.tokenizer_sha256:
        raise PairingError(
            Problem.TOKENIZER, "the tokenizer offered is not the one the server's model info names (its sha256 differs)"
        )
    download(stub, req, man, entries, cache, metadata=metadata, timeout_s=timeout_s, on_progress=on_progress)
    return check_tokenizer(cache.blob(entry).read_bytes(), info)


def server_tokenizer(session: Connected, override: str | Path = "") -> Tokenizer:
    """The tokenizer to decode a server-only stream with: `override` if given, else the server's (module
    docstring). ValueError (one line) for an override that is not the server's tokenizer."""
    info = session.model_info()
    if override:
        return load_tokenizer(override, info)
    cfg, link = session.cfg, session.link

    def progress(done: int, total: int) -> None:
        session.on_event(Event("download", count=done, total=total))

    def fetch() -> Tokenizer:
        return fetch_tokenizer(
            link.stub,
            info,
            cfg.cache_dir,
            metadata=link.metadata,
            max_bytes=cfg.max_weights_mb << 20,
            on_progress=progress,
        )

    def interrupted(e: Exception) -> None:
        session.on_event(Event("info", detail=f"tokenizer download interrupted ({e}); resuming"))

    return session.backoff.fresh().retry(fetch, attempts=DOWNLOAD_ATTEMPTS, on_retry=interrupted)


def load_tokenizer(path: str | Path, info: pb.ModelInfo) -> Tokenizer:
    """The tokenizer in `path` (a file, or a directory with tokenizer.json), if it is the server's."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    if file.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"--tokenizer {file}: larger than {MAX_TOKENIZER_BYTES >> 20} MiB, not a tokenizer")
    try:
        tokenizer = served_tokenizer(file.read_text(encoding="utf-8"), info)
    except Exception as e:  # the tokenizers library raises its own types on text it cannot read
        raise ValueError(f"--tokenizer {file} does not parse: {str(e)[:200]}") from None
    if tokenizer.sha256 != info.tokenizer_sha256:
        raise ValueError(
            f"--tokenizer {file} is not the server's tokenizer (its hash differs): give the tokenizer "
            f"of the model the server runs ({info.model_id or 'see tether-server serve'})"
        )
    return tokenizer


def first_chunk_s(cfg: ClientConfig) -> float:
    """How long a Generate stream's first chunk may take before the link counts as down."""
    return max(60.0, cfg.connect_timeout_s)


class ServerOnlySession:
    """Generate calls on a channel the caller owns; see the module docstring."""

    def __init__(
        self,
        stub,
        metadata: tuple,
        cfg: ClientConfig,
        info: pb.ModelInfo,
        tokenizer: Tokenizer,
        on_event: Callable[[Event], None] | None = None,
        stop_ids: Collection[int] | None = None,
        started_at: float | None = None,
    ):
        self.started_at = started_at  # when the command began (Stats.ttft_from_start_s); None: at the request
        self.stub, self.metadata, self.cfg, self.info, self.tokenizer = stub, metadata, cfg, info, tokenizer
        self.on_event = on_event or (lambda e: None)
        check_controls(cfg, info, tokenizer.vocab_size)
        self.stop_ids = frozenset(stop_ids) if stop_ids is not None else controls_stop_ids(cfg, info, tokenizer)
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
            raise ValueError("the prompt holds no tokens")
        cfg = self.cfg
        self._stop_asked = False
        self.stats = stats = Stats(server_only=True)
        self._set_state(State.CONNECTING)
        sampling = sampling_params(cfg, self.info)
        req = pb.OpenSession(
            prompt=prompt,
            max_new_tokens=cfg.max_new_tokens,
            sampling=sampling,
            model_fingerprint=self.info.model_fingerprint,
        )
        stats.bytes_up += 4 * len(prompt)
        t0 = time.monotonic()
        tokens: list[int] = []
        # No deadline on the whole call: a long generation streams for as long as it takes. A link is down when no
        # chunk comes in time: the first within FIRST_CHUNK_S (a prefill behind a loaded server's queue), each
        # later one within a round's timeout, as the adaptive client's stream.
        stream = GenerationStream(self.stub, req, self.metadata)
        try:
            while (msg := stream.receive(cfg.round_timeout_s if stream.chunks else first_chunk_s(cfg))) is not None:
                self._set_state(State.ONLINE)
                chunk = list(msg.tokens)
                vocab = self.tokenizer.vocab_size
                if len(tokens) + len(chunk) > cfg.max_new_tokens or not all(0 <= t < vocab for t in chunk):
                    raise ServerDataError(Problem.TOKEN, "Generate streamed a token outside the vocabulary or length")
                stats.bytes_down += 4 * len(chunk)
                end = next((i + 1 for i, t in enumerate(chunk) if t in self.stop_ids), None)
                chunk = chunk[:end]
                tokens += chunk
                stats.token_emitted(len(chunk), t0, time.monotonic(), self.started_at)
                self.on_event(Event("tokens", tokens=chunk, tag="verified"))
                if end is not None or len(tokens) >= cfg.max_new_tokens or self._stop_asked:
                    stats.stopped = self._stop_asked and end is None and len(tokens) < cfg.max_new_tokens
                    break
        finally:
            stream.close()  # a stop id or stop(): the server ends the generation and frees its KV
        stats.wall_s = time.monotonic() - t0
        self._set_state(State.DONE)
        return Result(list(prompt), tokens, ["verified"] * len(tokens), stats)
