"""An OpenAI-compatible HTTP API (Starlette, served by uvicorn) in front of anything that decodes token ids.

Contract:
- `OpenAIApp(backend, HttpConfig, observer=None)`: GET /health, GET /v1/models (and /v1/models/{id}), POST
  /v1/completions and POST /v1/chat/completions, streamed as server-sent events (`data: {...}` chunks, then
  `data: [DONE]`) or not. Requests are checked by tether.shared.openai_api before anything is allocated (the sampling
  controls' token ids, logit_bias and stop_token_ids, against the tokenizer's vocabulary here); the prompt is built
  here (the chat template and tokenizer of `backend.chat`, tether.shared.chat_template) and checked against the
  backend's limits (n against `max_n`); the request's n choices and their text, logprobs and streams are
  tether.shared.openai_generation's; the first token of each is awaited before the response starts, so a full server
  answers with a status (503 and Retry-After) rather than a broken stream. Every error has OpenAI's shape and its
  status: 400 malformed or too long (a prompt whose byte length alone shows it cannot fit is refused before it is
  tokenized), 401 without a valid `Authorization: Bearer KEY` (when keys are configured; /health stays open), 404 an
  unknown model or route, 408 a body that does not arrive in time, 413 a body over the limit, 429 past `max_streams`
  generations at once, 503 when the backend has no room, 500 only for a server bug (a chat template that does not
  compile is one; one that refuses the conversation, or runs past its bounds, is the caller's 400), logged in one line
  (tether.shared.http_observe).
  A client that goes away, streaming or not, closes its generation at once.
- Nothing CPU-bound runs on the event loop (which the gRPC server shares): decoding the body's JSON, checking it,
  rendering the chat template and tokenizing run on `config.prepare_threads` worker threads; at most
  `max_streams` requests are past their headers and not yet generating (more get 429), so the bodies held are
  bounded too. A body must arrive within `body_timeout_s` (else 408 and the connection closes); a stream its
  client stops reading for `send_timeout_s` ends, its generation closed.
- Every request is one log line and one observation (`observer`, tether.shared.http_observe: method, path,
  status, prompt and completion tokens, time to first token, duration, the response id as the session).
- `Backend` (a Protocol, beside the generations that run on it in tether.shared.openai_generation, which needs
  only the `App` shape of this app and so does not import it): `generate(prompt_ids, sampling, max_tokens)` is an
  async generator of `Tokens` chunks (closing it ends the generation); `sampling` is tether.shared.openai_api's
  Sampling: its `controls` (a checked SamplingControls) is the rule to decode with, its `stop_token_ids` end the
  text here, and so does end-of-text unless its `ignore_eos` (a backend may stop decoding at either too).
  `ApiError` from it becomes the response's status, or an error event mid-stream. tether.server.http_api adapts
  the gRPC service's server-only decoding to it, tether.client.edge_api the edge's sessions. A backend with
  `drafts_offline` may yield tokens marked offline; every choice it answers then carries tether's extension field,
  `"tether": {"offline_tokens": n}` (tether.shared.openai_api).
- `HttpServer(app, config).start(loop)` runs uvicorn as a task on an existing asyncio loop (the gRPC server's: one
  event loop for both) and returns the bound port (config.port 0 picks a free one), or raises OSError (one line:
  the address and the reason) when it cannot listen; `stop()` stops taking requests and gives those in flight
  `grace_s` seconds. Connections are guarded by tether.shared.http_guard: at most `max_connections` open (and
  at most half the file handles left to the process), a request head within `header_timeout_s`, idle keep-alive
  connections closed after `keep_alive_s`, the loop's repeated errors logged once per kind and window.

    app = OpenAIApp(backend, HttpConfig(port=8000))
    port = HttpServer(app, app.config).start(loop)
    # curl http://127.0.0.1:8000/v1/chat/completions -d '{"model": "m", "messages": [...], "stream": true}'
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tether.shared.chat_template import ChatTemplateError, TemplateProblem
from tether.shared.http_guard import (
    ConnectionGuard,
    connection_cap,
    guarded_protocol,
    install_loop_error_log,
    limit_logger,
)
from tether.shared.http_observe import HttpObserver, Observed, RequestRecord, record_of
from tether.shared.openai_api import (
    ApiError,
    ErrorKind,
    GenerationRequest,
    decode_body,
    invalid,
    parse_chat,
    parse_completion,
)
from tether.shared.openai_generation import Backend, Completion, EventStream

log = logging.getLogger("tether.http")


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # port to listen on (0: any free one)
    api_keys: frozenset[str] = frozenset()  # accepted bearer keys; empty = no authentication (loopback use)
    max_streams: int = 256  # generations at once; past it requests get 429 with Retry-After
    max_body_bytes: int = 4 << 20  # request bodies larger than this get 413
    retry_after_s: float = 1.0  # Retry-After advice when max_streams is reached
    completion_tokens: int = 16  # max_tokens of /v1/completions when the request gives none (OpenAI's default)
    grace_s: float = 5.0  # seconds requests in flight get to finish when the server stops
    tls_cert: str = ""  # PEM certificate: serve HTTPS (with tls_key)
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mutual TLS)
    max_connections: int = 1024  # connections open at once (also at most half the file handles left); past it 503
    header_timeout_s: float = 10.0  # a request's head (line and headers) must arrive within this; else 408, closed
    body_timeout_s: float = 30.0  # a request's body must arrive within this once its head has; else 408, closed
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    send_timeout_s: float = 60.0  # a stream the client does not read for this long is ended (its generation freed)
    prepare_threads: int = 2  # threads decoding, rendering and tokenizing requests (off the event loop)
    max_n: int = 8  # choices per request (n) at most; each takes a generation slot of max_streams


class OpenAIApp:
    def __init__(self, backend: Backend, config: HttpConfig | None = None, observer: HttpObserver | None = None):
        self.backend, self.config = backend, config or HttpConfig()
        self.created = int(time.time())
        self.live = 0  # generations running (event loop only)
        self.preparing = 0  # requests past their head and not yet generating (event loop only)
        self._threads = ThreadPoolExecutor(self.config.prepare_threads, thread_name_prefix="tether-http-prepare")
        self._keys = [hashlib.sha256(k.encode()).digest() for k in self.config.api_keys]
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._guard(self.model), methods=["GET"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
        ]
        # Starlette answers an exception a route lets out with the Exception handler, then raises it on to Observed,
        # which logs it in one line.
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        self.asgi = Observed(Starlette(routes=routes, exception_handlers=handlers), observer, log)

    def close(self) -> None:
        """Stop the worker threads (requests still preparing get no answer from them)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- routes ---------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generation(request, parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generation(request, parse_chat)

    # ---- checks -----------------------------------------------------------------------------------------------

    def _guard(self, endpoint: Callable) -> Callable:
        """Authentication, then the endpoint; every refusal as OpenAI's error JSON with its status (a bug is
        Observed's: a 500 and one log line)."""

        async def guarded(request: Request) -> Response:
            try:
                self._authorize(request)
                return await endpoint(request)
            except ApiError as e:
                return error_response(e)

        return guarded

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        kind = {404: ErrorKind.NOT_FOUND, 405: ErrorKind.METHOD_NOT_ALLOWED}.get(exc.status_code, ErrorKind.INTERNAL)
        return error_response(ApiError(kind, f"{request.method} {request.url.path}: {exc.detail}"))

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        return error_response(ApiError(ErrorKind.INTERNAL, "internal server error"))

    def _authorize(self, request: Request) -> None:
        if not self._keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(digest, k) for k in self._keys):
            raise ApiError(ErrorKind.UNAUTHENTICATED, "a valid API key is required: Authorization: Bearer KEY")

    def _model(self, name: str | None) -> str:
        if name is not None and name != self.backend.model_id:
            raise ApiError(
                ErrorKind.MODEL_NOT_FOUND,
                f"the model `{name}` does not exist; this server serves `{self.backend.model_id}`",
                "model",
            )
        return self.backend.model_id

    def _model_card(self) -> dict:
        return {
            "id": self.backend.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tether",
            "max_model_len": self.backend.max_context,
        }

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(ErrorKind.TOO_LARGE, f"the request body is over {limit} bytes")
        data = bytearray()
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                async for part in request.stream():
                    data += part
                    if len(data) > limit:
                        raise ApiError(ErrorKind.TOO_LARGE, f"the request body is over {limit} bytes")
        except TimeoutError:
            message = f"the request body did not arrive within {self.config.body_timeout_s:g} s"
            raise ApiError(ErrorKind.REQUEST_TIMEOUT, message) from None
        return bytes(data)

    async def _off_loop(self, fn: Callable, *args):
        """`fn(*args)` on one of the app's worker threads: CPU-bound work never holds the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def _prepare(self, data: bytes, parse: Callable[[object], GenerationRequest]):
        """On a worker thread: the body checked into a request, its model, prompt ids and token budget."""
        req = parse(decode_body(data))
        model = self._model(req.model)
        if req.n > self.config.max_n:
            raise invalid(f"n is at most {self.config.max_n} on this server", "n")
        self._token_ids(req)
        prompt = self._prompt(req)
        return req, model, prompt, self._max_tokens(req, len(prompt))

    def _token_ids(self, req: GenerationRequest) -> None:
        """The sampling's token ids (logit_bias, stop_token_ids) name tokens of the vocabulary."""
        vocab = self.backend.chat.tokenizer.vocab_size
        for param, ids in (
            ("logit_bias", [t for t, _ in req.sampling.logit_bias]),
            ("stop_token_ids", req.sampling.stop_token_ids),
        ):
            if any(t >= vocab for t in ids):
                raise invalid(f"{param}: token ids must be below the vocabulary size {vocab}", param)

    def _prompt(self, req: GenerationRequest) -> list[int]:
        chat, b = self.backend.chat, self.backend
        if req.messages is not None:
            try:
                ids = self._encode(chat.render(req.messages), "messages")
            except ChatTemplateError as e:
                if e.problem in (TemplateProblem.REFUSED, TemplateProblem.LIMIT):  # this conversation: the caller's
                    raise invalid(str(e), "messages") from None
                log.error("the model's chat template cannot render any conversation: %s", e)  # the operator's to fix
                raise ApiError(
                    ErrorKind.INTERNAL,
                    "the model's chat template is broken (the server log says how); /v1/completions still works",
                ) from None
        elif isinstance(req.prompt, str):
            ids = self._encode(req.prompt, "prompt")
        else:
            ids = list(req.prompt)
            if any(t >= chat.tokenizer.vocab_size for t in ids):
                raise invalid(
                    f"prompt token ids must be below the vocabulary size {chat.tokenizer.vocab_size}", "prompt"
                )
        if not ids:
            raise invalid("the prompt is empty", "messages" if req.chat else "prompt")
        if len(ids) > b.max_prompt_tokens:
            message = f"the prompt has {len(ids)} tokens; this server takes at most {b.max_prompt_tokens}"
            raise ApiError(ErrorKind.CONTEXT_LENGTH, message, "messages" if req.chat else "prompt")
        return ids

    def _encode(self, text: str, param: str) -> list[int]:
        limit = self.backend.max_prompt_tokens
        if self.backend.chat.surely_over(text, limit):  # refused without the seconds tokenizing it would take
            raise ApiError(
                ErrorKind.CONTEXT_LENGTH, f"the prompt has more than {limit} tokens, the most this server takes", param
            )
        return self.backend.chat.encode(text)

    def _max_tokens(self, req: GenerationRequest, prompt: int) -> int:
        b = self.backend
        room = min(b.max_context - prompt, b.max_new_tokens)
        if req.max_tokens is None:
            wanted = room if req.chat else min(self.config.completion_tokens, room)
        elif req.max_tokens > b.max_new_tokens:
            raise invalid(f"max_tokens is at most {b.max_new_tokens} on this server", "max_tokens")
        else:
            wanted = req.max_tokens
        if wanted < 1 or prompt + wanted > b.max_context:
            raise ApiError(
                ErrorKind.CONTEXT_LENGTH,
                f"this model's maximum context length is {b.max_context} "
                f"tokens; the request asks for {prompt + max(wanted, 1)} "
                f"({prompt} in the prompt)",
                "max_tokens",
            )
        return wanted

    # ---- generation -------------------------------------------------------------------------------------------

    async def _generation(self, request: Request, parse: Callable[[object], GenerationRequest]) -> Response:
        if self.preparing >= self.config.max_streams:
            message = f"{self.preparing} requests are being read, the limit is {self.config.max_streams}; try again"
            raise ApiError(ErrorKind.RATE_LIMITED, message, retry_after_s=self.config.retry_after_s)
        self.preparing += 1
        try:
            data = await self._body(request)
            req, model, prompt, max_tokens = await self._off_loop(self._prepare, data, parse)
        finally:
            self.preparing -= 1
        record = record_of(request.scope) or RequestRecord(request.method, request.url.path)
        record.prompt_tokens = len(prompt)
        if self.live + req.n > self.config.max_streams:
            message = f"{self.live} generations are running, the limit is {self.config.max_streams}; try again shortly"
            raise ApiError(ErrorKind.RATE_LIMITED, message, retry_after_s=self.config.retry_after_s)
        gen = Completion(self, req, model, prompt, max_tokens, record)
        await gen.start()
        if req.stream:
            return EventStream(
                gen.events(),
                self.config.send_timeout_s,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await gen.respond(request)

    def token_text(self, token: int) -> str:
        """A token's own text, as logprobs name it."""
        return self.backend.chat.tokenizer.decode([token])


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.kind.status, headers=e.headers())


class HttpServer:
    """uvicorn serving an OpenAIApp as a task on an asyncio loop that is already running (on another thread)."""

    def __init__(self, app: OpenAIApp, config: HttpConfig):
        self.app, self.config = app, config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._server = None
        self.guard: ConnectionGuard | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> int:
        """Bind, start serving on `loop` and return the port once requests are taken; OSError (its message one
        line, with the address) when it cannot listen there."""
        c = self.config
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((c.host, c.port))
        except OSError as e:
            sock.close()
            where = f"[{c.host}]:{c.port}" if ":" in c.host else f"{c.host}:{c.port}"
            raise OSError(e.errno, f"cannot listen on {where}: {e.strerror or e}") from None
        tls = dict(ssl_certfile=c.tls_cert, ssl_keyfile=c.tls_key) if c.tls_cert else {}
        if c.tls_client_ca:
            tls |= dict(ssl_ca_certs=c.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.guard = ConnectionGuard(connection_cap(c.max_connections), c.header_timeout_s, log)
        config = uvicorn.Config(
            self.app.asgi,
            lifespan="off",
            log_config=None,
            access_log=False,
            http=guarded_protocol(self.guard),
            timeout_keep_alive=c.keep_alive_s,
            timeout_graceful_shutdown=max(c.grace_s, 0.1),
            **tls,
        )
        limit_logger("uvicorn.error")  # a warning per malformed request otherwise
        self._loop = loop
        self._server = server = _Server(config)
        port = sock.getsockname()[1]

        async def begin() -> None:
            install_loop_error_log(loop, log)
            self._task = asyncio.create_task(server.serve(sockets=[sock]))
            ready = asyncio.ensure_future(server.ready.wait())
            await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
            if not server.ready.is_set():
                ready.cancel()
                await self._task  # raises what failed
                raise OSError(f"the HTTP server on {c.host}:{port} did not start")

        try:
            asyncio.run_coroutine_threadsafe(begin(), loop).result()
        except BaseException:
            sock.close()
            self.app.close()
            raise
        return port

    def stop(self) -> None:
        """Stop taking requests; those in flight get `grace_s` seconds, then they are cancelled."""
        if self._task is None:
            return

        async def end() -> None:
            self._server.should_exit = True
            await self._task

        asyncio.run_coroutine_threadsafe(end(), self._loop).result()
        self._task = None
        self.app.close()


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it has started (serve() itself returns only when it stops)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()
