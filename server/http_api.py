"""The server's OpenAI-compatible HTTP API: the target answers /v1/completions and /v1/chat/completions itself.

Contract:
- `EngineBackend(engine, model_id)` is tether.shared.openai_app's Backend over an Engine (tether.server.engine_core):
  a request's prompt and sampling (every control of tether.shared.openai_api.Sampling) go through the engine's own
  checks and its server-only decoding (engine.decoding, the Generate RPC's loop: tether.server.plain_decoding, or with
  --server-draft tether.server.server_draft), so HTTP generations share the paged KV pool, the model threads and the
  batcher with every gRPC Session and Generate stream, and are batched with them. The engine's refusals map onto HTTP:
  REASON_INVALID_REQUEST 400 (its param the field at fault), REASON_TOO_LONG 400 (context_length_exceeded),
  REASON_CAPACITY 503 with Retry-After. With Sampling.logprobs each chunk carries its tokens' log-probabilities: the
  processed distribution each token was drawn from (logit_bias and penalties applied, then temperature, top-k, top-p,
  min-p; greedy at temperature 1: tether.shared.sampling.token_logprobs), vLLM's "processed_logprobs". `outstanding`
  counts generations whose KV has not been given back yet; `wait_released(timeout)` waits until there are none (tests,
  shutdown).
- `start_http(engine, model_id, config)` serves the API on the gRPC server's event loop
  (tether.server.rpc_server.event_loop: uvicorn runs there as a task, so one loop routes both protocols and the
  model work stays on the engine's threads) and returns the running server and its port; OSError, its message
  one line naming the address, when it cannot listen (a port in use). Each request is observed in the engine's
  metrics (ServiceMetrics.http: tether_http_* on the metrics port) and logged in one line on "tether.http".

Why the same loop: handlers on both sides only route (decode() awaits futures of the engine's model threads and
batcher); one loop means the engine's state (its generation count, the session table's claims) is touched from
one thread, as tether.server.service assumes. What is CPU-bound in a request (JSON, the chat template, the
tokenizer) runs on the app's worker threads (tether.shared.openai_app), never on that loop.

    server, port = start_http(engine, "tether-default", HttpConfig(port=8000))
    ...
    server.stop()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator

from tether.server.auth import http_callers
from tether.server.engine_core import Engine
from tether.server.errors import Reason, RequestError
from tether.server.rpc_server import event_loop
from tether.shared.openai_api import ApiError, ErrorKind, Sampling, Tokens
from tether.v1 import tether_pb2 as pb

# The engine's refusals as HTTP errors; anything else it raises for a request is a server bug (500).
KINDS = {
    Reason.REASON_INVALID_REQUEST: ErrorKind.INVALID_REQUEST,
    Reason.REASON_TOO_LONG: ErrorKind.CONTEXT_LENGTH,
    Reason.REASON_CAPACITY: ErrorKind.OVERLOADED,
}


def api_error(e: RequestError) -> ApiError:
    kind = KINDS.get(e.reason, ErrorKind.INTERNAL)
    return ApiError(
        kind,
        e.message if kind is not ErrorKind.INTERNAL else "internal server error",
        e.field,
        retry_after_s=e.retry_after_s,
    )


def sampling_params(sampling: Sampling) -> pb.SamplingParams:
    """The HTTP request's sampling on the wire (what server-only decoding takes), every control included."""
    return pb.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias),
        stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos,
    )


class EngineBackend:
    """An OpenAIApp backend decoding on an Engine (see the module docstring)."""

    drafts_offline = False  # the target decides every token

    def __init__(self, engine: Engine, model_id: str):
        self.decoding, self.model_id = engine.decoding, model_id
        self.chat = engine.chat_format
        self.max_context = engine.target.cfg.max_seq_len
        self.max_prompt_tokens = engine.config.max_prompt_tokens
        self.max_new_tokens = engine.config.max_new_tokens
        self.outstanding = 0  # generations whose KV is still held (any thread)
        self._released = threading.Condition()

    async def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int) -> AsyncIterator[Tokens]:
        params = sampling_params(sampling)
        try:
            ids = self.decoding.check_generation(prompt, params)
        except RequestError as e:
            raise api_error(e) from None
        with self._released:
            self.outstanding += 1
        # Decoding ends where the app's text does: at the stop tokens, and at end-of-text unless ignore_eos.
        reported = None if sampling.logprobs is None else []
        chunks = self.decoding.decode(
            ids,
            params,
            max_tokens,
            released=self._release,
            stop_ids=self.decoding.stop_ids(params),
            logprobs=reported,
            top_logprobs=sampling.logprobs or 0,
        )
        try:
            async with contextlib.aclosing(chunks):
                sent = 0
                async for chunk in chunks:
                    logprobs = None if reported is None else tuple(reported[sent : sent + len(chunk)])
                    sent += len(chunk)
                    yield Tokens(chunk, logprobs=logprobs)
        except RequestError as e:
            raise api_error(e) from None

    def _release(self) -> None:
        with self._released:
            self.outstanding -= 1
            self._released.notify_all()

    def wait_released(self, timeout: float) -> bool:
        """True once every generation's KV has been given back (False if that takes over `timeout` seconds)."""
        with self._released:
            return self._released.wait_for(lambda: self.outstanding == 0, timeout)


def start_http(engine: Engine, model_id: str, config):
    """Serve the OpenAI-compatible API for `engine` on the gRPC event loop: (HttpServer, bound port). `config` is
    a tether.shared.openai_app.HttpConfig."""
    from tether.shared.openai_app import HttpServer, OpenAIApp

    app = OpenAIApp(EngineBackend(engine, model_id), config, observer=engine.metrics.http)
    app.asgi = http_callers(app.asgi, engine.config.api_keys)  # each client's model work counted as its own
    server = HttpServer(app, config)
    return server, server.start(event_loop())
