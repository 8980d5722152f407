"""The client's typed error for what the server sent and the client refuses: one class, one reason enum.

Contract: every refusal caused by the server's data (model info, the weight manifest and its chunks, the cache
keys in it, the tokenizer, KV deltas, verdicts, token ids) raises ServerDataError, or a subclass
(tether.client.pairing.PairingError, tether.client.weight_cache.WeightCacheError, the session's refused
messages), carrying a `Problem`. Programs branch on `.problem`, never on the message text. It is a ValueError,
so `tether-client` reports it in one line on stderr with exit status 2 (tether.shared.cli_support.run_cli).

    try:
        pair()
    except ServerDataError as e:
        if e.problem == Problem.WEIGHT_SIZE: ...
"""

from __future__ import annotations

from enum import StrEnum


class Problem(StrEnum):
    """What was wrong; the value reads after "invalid" in the message."""

    MODEL_INFO = "model info"  # GetModelInfo fields malformed or out of range
    FINGERPRINT = "fingerprint"  # identities that contradict each other
    MANIFEST = "weight manifest"  # tensors, dtypes, shapes or sizes the model's config does not imply
    GRAPH = "ONNX graph"  # a graph our exporter would not emit, or a graph call past its run-time bounds
    WEIGHT_SIZE = "weight size"  # a client part larger than the client accepts (ClientConfig.max_weights_mb)
    CACHE_KEY = "cache key"  # a sha256 field that is not 64 lowercase hex digits (it names files)
    CHUNK = "weight chunk"  # a chunk of an unknown tensor, past its end, leaving a gap, or one too many
    CHECKSUM = "weight checksum"  # downloaded bytes that fail their sha256
    TOKENIZER = "tokenizer"  # a tokenizer that does not parse or does not match its hash
    DELTA = "KV delta"  # a KV delta whose positions, tokens, tensors or size the session does not allow
    VERDICT = "verdict"  # a reply that does not answer the round sent
    TOKEN = "token id"  # a token id outside the vocabulary
    LOGPROBS = "token logprobs"  # reported logprobs that are not of the tokens emitted, or not log-probabilities
    SESSION_ID = "session id"  # a session id or resume token not of the server's shape (32 lowercase hex digits)


class ServerDataError(ValueError):
    """The server sent something invalid; `problem` says what."""

    def __init__(self, problem: Problem, message: str):
        super().__init__(f"the server sent an invalid {problem.value}: {message}")
        self.problem = problem
