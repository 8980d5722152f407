"""The edge session's vocabulary: what a caller configures, the events and states it is told about, and what a
generation returns. The session itself is tether.client.session, which re-exports the names its callers use.

Contract:
- `ClientConfig`: frozen; one field per `tether-client generate` flag (the trailing comment of each field is its
  --help). CHOICES names the values its string fields of a fixed set take (the CLI offers them as choices);
  `cfg.check()` raises ValueError for another, and EdgeSession checks its config so. `cfg.controls()`: its
  sampling rule (SAMPLING_FIELDS) as SamplingControls, checked (ControlError names the control out of range).
- `State`: CONNECTING -> ONLINE -> OFFLINE -> RESYNCING -> ONLINE ... -> DONE (docs/ARCHITECTURE.md, section 7).
- `Event`: what the session reports as it goes ("state", with a short human reason for OFFLINE; "tokens" tagged
  verified or offline; "verify": `count` offline tokens from index `start` of the generated ones, which a resync
  kept, are tagged verified now; "retract"; "info"; "download": `count` of `total` bytes of the client part
  fetched so far, only while a download runs; "mode": the online mode switched to, `detail` "stream" or "hybrid",
  tether.client.adaptive). With EdgeSession.logprobs set, "tokens" carry one TokenLogprobs
  per token (`logprobs`).
- `Stats` and `Result`: a generation's counters and its token ids; `Result.continuation(tokenizer, ends)` the text
  it adds to its prompt (its callers decode: the session yields ids), `Result.to_json(text)` `tether-client
  --json`'s line.
  Time to first token runs from sending the prompt (pairing done) to its first token (`ttft_s`), and from the
  command's start (`ttft_from_start_s`: imports, pairing and downloads included, what a user waits); tokens/s is
  the rate after it: (tokens - 1) / (last token's time - first token's).
- `Paired`: what pairing gave the session, whichever the backend: model info, tokenizer, drafter, bytes.
Importing this module imports no torch and no onnxruntime.

    cfg = ClientConfig(server="127.0.0.1:50051", backend="onnx", precision="int8")
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from tether.client.mode_choice import MODES
from tether.shared.logits_processing import ControlError, SamplingControls
from tether.shared.sampling import TokenLogprobs
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import ONNX_PRECISIONS
from tether.shared.wire import Codec
from tether.v1 import tether_pb2 as pb

BACKENDS = ("onnx", "torch")  # the drafter runtimes; torch only to compare against (it needs torch installed)
PRECISIONS = ONNX_PRECISIONS  # the weights of the ONNX client part on the wire
POLICIES = ("keep", "rewind")
CODECS = {
    "lossless": Codec.FP16_SHUFFLE_ZSTD,
    "int8": Codec.INT8_ZSTD,
    "int4": Codec.INT4_HADAMARD,
    "int3": Codec.INT3_HADAMARD,
    "int2": Codec.INT2_HADAMARD,
    "raw": Codec.RAW,
}
# Each codec above the one before it in what it keeps: a choice is offered first, then those that lose less, so a
# server without it sends more bytes of states no worse, never fewer of worse ones.
_BY_LOSS = (Codec.INT2_HADAMARD, Codec.INT3_HADAMARD, Codec.INT4_HADAMARD, Codec.INT8_ZSTD, Codec.FP16_SHUFFLE_ZSTD)
_BEFORE_OFFERS = frozenset({Codec.RAW, Codec.FP16_SHUFFLE_ZSTD, Codec.INT8_ZSTD})  # what servers read before
SHAPES = ("chain", "tree", "auto")  # a round's draft (tether.client.round_plan)
CHOICES = {
    "mode": MODES,
    "policy": POLICIES,
    "backend": BACKENDS,
    "precision": PRECISIONS,
    "codec": tuple(CODECS),
    "tree": SHAPES,
}
# The fields of the sampling rule (a request of the edge's HTTP API brings its own: tether.client.edge_serve).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_token_ids",
    "ignore_eos",
    "seed",
)


class State(StrEnum):
    CONNECTING = "connecting"
    ONLINE = "online"
    OFFLINE = "offline"
    RESYNCING = "resyncing"
    DONE = "done"


@dataclass(frozen=True)
class ClientConfig:
    server: str = "127.0.0.1:50051"  # HOST:PORT of tether-server or a load balancer; a comma list = replicas
    max_new_tokens: int = 128  # tokens to generate (verified and offline together)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling threshold
    top_k: int = 0  # keep the k most probable tokens before top_p (0: off)
    min_p: float = 0.0  # drop tokens below min_p x the most probable one's probability (0: off)
    presence_penalty: float = 0.0  # in [-2, 2]: taken from the logit of every token generated so far
    frequency_penalty: float = 0.0  # in [-2, 2]: taken from a token's logit once per time it was generated
    repetition_penalty: float = 1.0  # > 0: a token of the prompt or text has its logit divided by it (1: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # ID=BIAS, repeatable: BIAS in [-100, 100] added to ID's logit
    stop_token_ids: tuple[int, ...] = ()  # ids that end the generation besides the model's end-of-text
    ignore_eos: bool = False  # end-of-text ids do not end the generation (stop token ids do): fixed lengths
    seed: int = 0  # sampling seed (drafter and server)
    mode: str = "auto"  # online: "auto" streams the server's decoding while faster, else drafts here; or force one
    policy: str = "keep"  # after an outage: "keep" the offline text, or "rewind" it to what the target agrees with
    backend: str = "onnx"  # drafter runtime: "onnx" (onnxruntime, no torch needed) or "torch"
    precision: str = "fp32"  # "fp32", "fp16" or "int8": ONNX weights on the wire (int8 also computes in int8)
    threads: int = 1  # onnxruntime intra-op threads of the ONNX drafter (0: one per core); 1 suits small drafters
    k: int = 5  # draft tokens per round (a chain's)
    tree: str = "auto"  # draft shape: "chain", "tree", or "auto" (a tree while the round trip dwarfs drafting)
    tree_nodes: int = 32  # the most draft nodes of a tree round (the server's max_tree_nodes caps it)
    tree_depth: int = 12  # levels a draft tree grows (its longest path)
    tree_top_k: int = 3  # children of each node a tree expands, and nodes expanded per level
    pipeline: bool = True  # draft the next round while this one is verified
    overlap: bool = True  # with pipeline: send that round before the verdict, where the server takes it (ModelInfo)
    overlap_depth: int = 2  # with overlap, greedy: rounds sent ahead of the one in flight (sampling: 1; rounds.py)
    codec: str = "lossless"  # KV-delta codec: lossless (fp16 shuffle + zstd), int8 (+ zstd), int4/int3/int2 or raw
    api_key: str = ""  # bearer key, when the server asks for one (others can read argv: prefer TETHER_API_KEY)
    tls_ca: str = ""  # PEM CA bundle to verify the server: TLS (empty = plaintext)
    tls_cert: str = ""  # PEM client certificate (mTLS)
    tls_key: str = ""  # PEM key of tls_cert
    cache_dir: str = "~/.cache/tether"  # downloaded client weights, by sha256
    round_timeout_s: float = 5.0  # a round unanswered this long means the link is down
    connect_timeout_s: float = 10.0  # deadline of GetModelInfo, open, resync and attach
    backoff_initial_s: float = 0.2  # first reconnection delay
    backoff_max_s: float = 5.0  # reconnection delay cap
    backoff_jitter: float = 0.2  # +- fraction of random jitter on each delay
    keepalive_s: float = 10.0  # gRPC keepalive ping interval (detects dead links without traffic)
    pace_tokens_per_s: float = 0.0  # cap the output rate (a slower device, a reader); 0 = as fast as possible
    max_offline_tokens: int = 0  # stop drafting alone after this many tokens in one outage; 0 = no limit
    resync_piece_tokens: int = 1024  # offline tokens per Resync call (each reply's KV delta stays well under 4 MiB)
    final_resync_s: float = 30.0  # rewind: how long to wait for the link when generation ends offline
    session_file: str = ""  # save the session here as it goes; a restarted client resumes from it
    max_weights_mb: int = 2048  # refuse a server whose client part (weights and tokenizer) is over this many MiB

    def check(self) -> None:
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        for name in ("tree_nodes", "tree_depth", "tree_top_k", "overlap_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads must be at least 0, not {self.threads}")
        if self.k < 0:
            raise ValueError(f"k must be at least 0, not {self.k}")
        if self.mode == "stream" and (self.presence_penalty or self.frequency_penalty):
            raise ValueError(
                "mode stream restarts the server's decoding over the text at each switch, which would "
                "count the text generated before as prompt: presence and frequency penalties need "
                "mode hybrid or auto"
            )
        self.controls()
        if any(t < 0 for t in self.stop_token_ids):
            raise ControlError(
                "stop_token_ids", f"stop_token_ids must be token ids >= 0, got {min(self.stop_token_ids)}"
            )

    def controls(self) -> SamplingControls:
        """The sampling rule these settings ask for; ControlError (a ValueError naming the control) when one is
        out of its range."""
        return SamplingControls.of(self)


@dataclass
class Event:
    kind: str  # "state", "tokens", "verify", "retract", "info", "download", "mode" (detail: "stream" or "hybrid")
    state: State | None = None
    tokens: list[int] = field(default_factory=list)
    tag: str = ""  # "verified" or "offline" for "tokens"
    count: int = 0  # tokens retracted or verified; bytes fetched ("download")
    start: int = 0  # "verify": the index among the generated tokens of the first one verified
    total: int = 0  # bytes to fetch ("download")
    detail: str = ""
    # "tokens", when the session reports logprobs (EdgeSession.logprobs): one per token, the server's for verified
    # tokens, the drafter's own for offline ones (tether.client.logprobs)
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class Stats:
    rounds: int = 0
    drafted: int = 0  # draft tokens sent (a tree's nodes)
    accepted: int = 0
    offline_tokens: int = 0
    retracted: int = 0
    resyncs: int = 0
    rebuilt: int = 0
    outages: int = 0
    failovers: int = 0  # switches to another endpoint of --server's list
    bytes_up: int = 0
    bytes_down: int = 0
    weights_bytes: int = 0
    tree_rounds: int = 0  # rounds that sent a draft tree (the others sent chains)
    pipeline_hits: int = 0  # rounds sent as drafted ahead while the round before them was verified
    pipeline_discarded: int = 0  # rounds drafted ahead and thrown away (the verdict went otherwise, or the link)
    overlapped: int = 0  # of pipeline_hits, those sent before the verdict of the round before them (overlap)
    rows_kept: int = 0  # verdicts after which the drafter kept the rows drafted for the rounds pending (no re-feed)
    bad_messages: int = 0  # server messages refused as invalid (each one a lost round or resync)
    stream_tokens: int = 0  # tokens streamed from the server's own decoding (mode stream or auto)
    mode_switches: int = 0  # changes of online mode (tether.client.adaptive), the first stream after the open included
    switch_s: list[float] = field(default_factory=list)  # each switch's time: to streaming, until its first chunk;
    # to the hybrid, the catch-up (its Resync calls and the attach)
    switch_bytes: list[tuple[int, int]] = field(default_factory=list)  # each switch's payload bytes (up, down)
    # Where ONLINE rounds' time goes (a round's time is about verdict_wait + verdict_to_send, per round):
    round_work_s: float = 0.0  # not waiting for verdicts: drafting (ahead too), adopting deltas, sending
    verdict_wait_s: float = 0.0  # from sending each round to its verdict's arrival: round trip and server
    verdict_to_send_s: float = 0.0  # from each verdict's arrival to the next round's sending: the client's part of
    # the critical path (a round drafted ahead goes out at once; otherwise the delta is adopted and a round drafted)
    wall_s: float = 0.0
    ttft_s: float = 0.0  # time to first token: from sending the prompt (pairing done) to its first token
    ttft_from_start_s: float = 0.0  # time to first token from the command's start (pairing and downloads included)
    decode_s: float = 0.0  # from the first token to the last
    emitted: int = 0  # tokens emitted (retracted ones included)
    server_only: bool = False  # the server runs no drafter: it decoded alone (Generate) and nothing was drafted
    stopped: bool = False  # stopped early (stop(): Ctrl-C, a client that went away)
    reopened: int = 0  # chat: turns that opened a new server session instead of extending the one held
    resync_s: list[float] = field(default_factory=list)  # each resync's duration
    resync_bytes: list[tuple[int, int]] = field(default_factory=list)  # each Resync call's payload bytes (up, down)
    _first = 0.0  # when the first token came (time.monotonic()); not a field, so not in --json

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        """Tokens a second after the first (0 before a second token)."""
        return (self.emitted - 1) / self.decode_s if self.emitted > 1 and self.decode_s > 0 else 0.0

    def token_emitted(self, n: int, start: float, now: float, began: float | None = None) -> None:
        """Count `n` tokens emitted at `now` for a prompt sent at `start` by a command that began at `began`
        (time.monotonic(); None: at `start`)."""
        if not self.emitted:
            self.ttft_s = now - start
            self.ttft_from_start_s = now - (start if began is None else began)
            self._first = now
        self.emitted += n
        self.decode_s = now - self._first


@dataclass
class Result:
    """A generation as token ids (its caller decodes them: `continuation`)."""

    prompt_ids: list[int]
    token_ids: list[int]
    tags: list[str]
    stats: Stats

    def to_json(self, text: str) -> dict:
        """`tether-client --json`'s line, with `text`, the continuation decoded."""
        s = asdict(self.stats)
        s["tau"] = self.stats.tau
        s["tokens_per_s"] = self.stats.tokens_per_s
        return {"text": text, "token_ids": self.token_ids, "tags": self.tags, "stats": s}

    def continuation(self, tokenizer: Tokenizer, ends: Collection[int] = ()) -> str:
        """The text the continuation adds to its prompt (decoded after it, a first space kept), without the ids in
        `ends` (those it ended at: the session's stop ids)."""
        return tokenizer.decode([t for t in self.token_ids if t not in ends], after=self.prompt_ids)


@dataclass(frozen=True)
class Paired:
    """What pairing gives a session, whichever the backend."""

    info: pb.ModelInfo
    tokenizer: Tokenizer
    drafter: Any  # an OnnxDrafter, or the torch drafter module (tether.shared.drafter)
    nbytes: int  # the client part's bytes (weights and tokenizer), as downloaded or found in the cache


def codec_fields(name: str) -> dict[str, Codec | list[Codec]]:
    """The codec fields of an OpenSession or ResyncRequest for `name` (a CODECS key): accept_codecs offers it, then
    each codec that loses less (RAW after lossless); delta_codec, what a server that reads no offer sends, is the
    first of those such a server knows."""
    chosen = CODECS[name]
    offer = [chosen] if chosen == Codec.RAW else [*_BY_LOSS[_BY_LOSS.index(chosen) :], Codec.RAW]
    return {"delta_codec": next(c for c in offer if c in _BEFORE_OFFERS), "accept_codecs": offer}
