"""The OpenAI-compatible API's protocol, without a web framework or a model: requests checked into frozen values,
errors in OpenAI's shape, token ids turned into text with stop strings, and the response and SSE chunk bodies.

Contract:
- `parse_completion(body)` / `parse_chat(body)` take the decoded JSON body of POST /v1/completions and
  /v1/chat/completions and return a `GenerationRequest`, or raise `ApiError` (400, `param` naming the field) for
  anything malformed: a wrong type (a bool is not a number), a value out of range, a field OpenAI does not have,
  or one tether does not implement at other than its neutral value (tools, echo, best_of ...), so nothing is
  silently ignored. Supported: model, prompt (a string, a token-id list, or a list of one of either) / messages,
  max_tokens (max_completion_tokens), temperature [0, 2], top_p (0, 1], top_k (0 or -1: off), seed, stop (a string
  or up to 16), stream, stream_options.include_usage, n in [1, MAX_N] (the app may allow fewer; choice i samples
  with seed + i), logprobs (completions: the number of top tokens, [0, MAX_LOGPROBS]; chat: a bool, with
  top_logprobs [0, MAX_LOGPROBS]), user, presence_penalty and
  frequency_penalty [-2, 2], logit_bias ({"token id": bias in [-100, 100]}, up to MAX_LOGIT_BIAS entries), and
  vLLM's min_p [0, 1], repetition_penalty (> 0), stop_token_ids (up to MAX_STOP_TOKEN_IDS ids that end the
  generation, their text left out, as vLLM does) and ignore_eos (generate through end-of-text: benchmarks). The
  sampling fields become `Sampling` (its `controls` is tether.shared.logits_processing's SamplingControls, whose
  ranges are the ones checked; token ids are checked against the vocabulary by the app, which knows it). Every
  string used must be valid Unicode (a lone surrogate, which
  JSON's \\ud800 escapes can carry, is refused: no tokenizer or encoder downstream takes one); top_k is at most
  MAX_TOP_K (the wire's field is 32 bits).
- `decode_body(data)`: a request body's bytes as JSON, or ApiError (400) for anything else: not JSON, NaN or
  Infinity, numbers with too many digits, nesting past Python's recursion limit. CPU-bound on large bodies: callers
  on an event loop run it on a worker thread.
- `ApiError(kind, message, param, retry_after_s)`: `ErrorKind` fixes the HTTP status, OpenAI's error type and
  code; `body()` is {"error": {"message", "type", "param", "code"}}; `headers()` carries Retry-After (and
  `Connection: close` for a 408: the rest of that request's body is never read). The message and param are kept
  encodable whatever a caller sent (a lone surrogate in an unknown field's name becomes U+FFFD).
- `Tokens(ids, offline, verified, logprobs, drafter_logprobs)`: a chunk of token ids as a backend yields them;
  `offline` marks ids the edge drafted alone while its link was down, `verified` says how many offline ids sent
  before a resync has since kept (the response's extension: tether.shared.openai_responses.with_offline).

The rest of the protocol is beside it: tether.shared.text_stream (token ids -> the text to show, stop strings
and stop ids) and tether.shared.openai_responses (the response and SSE chunk bodies).
Torch- and gRPC-free: the server's HTTP API (tether.server.http_api) and an edge endpoint use it alike.

    req = parse_chat(json.loads(body))
    req.sampling.controls, req.stop, req.max_tokens
"""

from __future__ import annotations

import enum
import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.shared.logits_processing import ControlError, SamplingControls
from tether.shared.sampling import TokenLogprobs

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_MESSAGES = 4096  # chat messages per request
SEED_RANGE = (-(1 << 63), 1 << 64)  # accepted seeds; negative ones are taken modulo 2^64
MAX_TOP_K = (1 << 31) - 1  # past any vocabulary; the wire's SamplingParams.top_k is a uint32
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request (the gRPC server's bound too)
MAX_LOGPROBS = 20  # top tokens reported per token (OpenAI's top_logprobs bound)
MAX_N = 128  # choices per request at most (HttpConfig.max_n is the server's own, smaller, bound)

COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "ignore_eos",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
ROLES = {"system", "developer", "user", "assistant", "tool"}


class ErrorKind(enum.Enum):
    """Each refusal's HTTP status, OpenAI error type and code (the value's order)."""

    INVALID_REQUEST = (400, "invalid_request_error", "invalid_request")
    CONTEXT_LENGTH = (400, "invalid_request_error", "context_length_exceeded")
    UNAUTHENTICATED = (401, "authentication_error", "invalid_api_key")
    NOT_FOUND = (404, "invalid_request_error", "not_found")
    MODEL_NOT_FOUND = (404, "invalid_request_error", "model_not_found")
    METHOD_NOT_ALLOWED = (405, "invalid_request_error", "method_not_allowed")
    REQUEST_TIMEOUT = (408, "invalid_request_error", "request_timeout")  # the body did not arrive in time
    TOO_LARGE = (413, "invalid_request_error", "request_too_large")
    RATE_LIMITED = (429, "rate_limit_error", "rate_limit_exceeded")
    INTERNAL = (500, "server_error", "internal_error")
    UPSTREAM = (502, "server_error", "upstream_error")  # a gateway's upstream (the edge's tether server) refused
    OVERLOADED = (503, "server_error", "overloaded")
    UNREACHABLE = (503, "server_error", "server_unreachable")  # a gateway's upstream (the edge's server) is down

    @property
    def status(self) -> int:
        return self.value[0]


class ApiError(Exception):
    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, retry_after_s: float = 0.0):
        message, param = _encodable(message), None if param is None else _encodable(param)
        super().__init__(message)
        self.kind, self.message, self.param, self.retry_after_s = kind, message, param, retry_after_s

    def body(self) -> dict:
        _, kind, code = self.kind.value
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def headers(self) -> dict[str, str]:
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))} if self.retry_after_s > 0 else {}
        return headers | ({"Connection": "close"} if self.kind is ErrorKind.REQUEST_TIMEOUT else {})


def _encodable(text: str) -> str:
    """`text` as UTF-8 can carry it: lone surrogates (from JSON escapes) as U+FFFD."""
    if _is_unicode(text):
        return text
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (no UTF-8 encoder or tokenizer takes one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param)


@dataclass(frozen=True)
class Tokens:
    """A chunk of generated token ids, as a backend yields them."""

    ids: list[int]  # in order, after those of the chunks before
    offline: bool = False  # drafted at the edge while the link was down, and not verified by the target
    verified: int = 0  # of the offline tokens chunks before this one carried, how many a resync has since kept
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per id, when the request asked (Sampling.logprobs)
    drafter_logprobs: bool = False  # those logprobs are the edge drafter's own: tokens the target never scored


@dataclass(frozen=True)
class Sampling:
    """A request's sampling: what a backend decodes with. `controls` is the rule (tether.shared.logits_processing);
    `stop_token_ids` end the generation besides the model's end-of-text ids (the app's TextStream stops there; a
    backend may stop decoding there too)."""

    temperature: float = 1.0  # 0: greedy (OpenAI's default is 1)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # keep the k most probable tokens; 0: off
    seed: int = 0  # in [0, 2^64); drawn at random when the request gives none
    min_p: float = 0.0  # in [0, 1]; 0: off
    presence_penalty: float = 0.0  # in [-2, 2], over the generated tokens
    frequency_penalty: float = 0.0  # in [-2, 2], over the generated tokens
    repetition_penalty: float = 1.0  # > 0, over prompt and generated tokens; 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # report each token's logprob and this many top ones (None: no logprobs)
    ignore_eos: bool = False  # vLLM's extension: end-of-text does not end the generation, stop_token_ids do

    @property
    def controls(self) -> SamplingControls:
        return SamplingControls.of(self)


@dataclass(frozen=True)
class GenerationRequest:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    model: str | None  # the model named; None: the one served
    prompt: str | tuple[int, ...] | None  # completions: text, or token ids
    messages: tuple[dict, ...] | None  # chat: {"role", "content"} with content as one string
    max_tokens: int | None  # None: the endpoint's default
    sampling: Sampling
    stop: tuple[str, ...]  # stop strings, matched on the decoded text
    stream: bool  # server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    n: int = 1  # choices, each generated on its own (choice i with seed + i)


def parse_completion(body: Any) -> GenerationRequest:
    f = _Fields(body, COMPLETION_FIELDS)
    for name, neutral in (("echo", (False,)), ("best_of", (1,)), ("suffix", ("",))):
        f.neutral(name, neutral)
    logprobs = None if f.get("logprobs") in (None, False) else f.integer("logprobs", 0, MAX_LOGPROBS)
    prompt = f.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(t >= 0 for t in prompt):
            raise invalid("prompt token ids must be non-negative", "prompt")
        prompt = tuple(prompt)
    elif isinstance(prompt, list):
        raise invalid("one prompt per request: a string or a list of token ids", "prompt")
    elif not isinstance(prompt, str):
        raise invalid("prompt is required: a string or a list of token ids", "prompt")
    else:
        _unicode(prompt, "prompt")
    return _request(
        f, chat=False, prompt=prompt, messages=None, max_tokens=f.integer("max_tokens", 1), logprobs=logprobs
    )


def parse_chat(body: Any) -> GenerationRequest:
    f = _Fields(body, CHAT_FIELDS)
    for name, neutral in (("tools", ([],)), ("tool_choice", ("none", "auto"))):
        f.neutral(name, neutral)
    top = f.integer("top_logprobs", 0, MAX_LOGPROBS)
    if not f.typed("logprobs", bool) and top:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if f.get("logprobs") else None
    if f.get("response_format") not in (None, {"type": "text"}):
        raise invalid('response_format: only {"type": "text"} is supported', "response_format")
    f.typed("parallel_tool_calls", bool)
    messages = f.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise invalid(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    checked = tuple(_message(m, i) for i, m in enumerate(messages))
    limit = f.integer("max_completion_tokens", 1)
    return _request(
        f, chat=True, prompt=None, messages=checked, max_tokens=limit or f.integer("max_tokens", 1), logprobs=logprobs
    )


def _message(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
        raise invalid(f"{param} needs a role, one of {', '.join(sorted(ROLES))}", f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones, joined as vLLM joins them
        if not all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            raise invalid(f"{param}.content: only text parts are supported", f"{param}.content")
        content = "\n".join(p["text"] for p in content)
    if content is None and m["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    _unicode(content, f"{param}.content")
    extra = set(m) - {"role", "content", "name"}
    if extra:
        raise invalid(f"{param}: unsupported field {sorted(extra)[0]!r} (tool calls are not supported)", param)
    if "name" in m and not isinstance(m["name"], str):
        raise invalid(f"{param}.name must be a string", f"{param}.name")
    if "name" in m:
        _unicode(m["name"], f"{param}.name")
    return {"role": m["role"], "content": content} | ({"name": m["name"]} if "name" in m else {})


def _request(
    f: _Fields, *, chat: bool, prompt, messages, max_tokens: int | None, logprobs: int | None
) -> GenerationRequest:
    model = f.typed("model", str)
    n = f.integer("n", 1, MAX_N) or 1
    f.typed("user", str)
    temperature = f.number("temperature", 0.0, 2.0)
    top_p = f.number("top_p", 0.0, 1.0)
    if top_p == 0:
        raise invalid("top_p must be in (0, 1]", "top_p")
    top_k = f.integer("top_k", -1, MAX_TOP_K)
    seed = f.integer("seed", SEED_RANGE[0], SEED_RANGE[1] - 1)
    stream = bool(f.typed("stream", bool))
    options = f.get("stream_options")
    if options is not None and (not stream or not isinstance(options, Mapping) or set(options) - {"include_usage"}):
        raise invalid('stream_options is {"include_usage": bool}, and only with stream', "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage must be a boolean", "stream_options")
    stop = f.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is None:
        stop = ()
    if (
        not isinstance(stop, list | tuple)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise invalid(f"stop must be a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    for s in stop:
        _unicode(s, "stop")
    sampling = Sampling(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        seed=secrets.randbits(63) if seed is None else seed % (1 << 64),
        logprobs=logprobs,
        ignore_eos=bool(f.typed("ignore_eos", bool)),
        **_controls(f),
    )
    return GenerationRequest(chat, model, prompt, messages, max_tokens, sampling, tuple(stop), stream, include_usage, n)


def _controls(f: _Fields) -> dict[str, Any]:
    """The logits controls and stop token ids, as Sampling's fields; their ranges are SamplingControls' own."""
    values = {
        name: value
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        if (value := f.real(name)) is not None
    }
    bias = f.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS:
            raise invalid(
                f'logit_bias must be an object of up to {MAX_LOGIT_BIAS} "token id": bias entries', "logit_bias"
            )
        if not all(
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 and int(k) < 1 << 32 for k in bias
        ):
            raise invalid("logit_bias keys must be token ids written as decimal strings", "logit_bias")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in bias.values()):
            raise invalid("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        values["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
    try:
        controls = SamplingControls(**values)
    except ControlError as e:
        raise invalid(str(e), e.control) from None
    stop_ids = f.get("stop_token_ids")
    if stop_ids is not None and (
        not isinstance(stop_ids, list)
        or len(stop_ids) > MAX_STOP_TOKEN_IDS
        or not all(_is_int(t) and 0 <= t < 1 << 32 for t in stop_ids)
    ):
        raise invalid(f"stop_token_ids must be a list of up to {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    return {
        "min_p": controls.min_p,
        "presence_penalty": controls.presence_penalty,
        "frequency_penalty": controls.frequency_penalty,
        "repetition_penalty": controls.repetition_penalty,
        "logit_bias": controls.logit_bias,
        "stop_token_ids": tuple(dict.fromkeys(stop_ids or ())),
    }


def _unicode(text: str, param: str) -> None:
    if not _is_unicode(text):
        raise invalid(f"{param} holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape): not valid Unicode", param)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_body(data: bytes | bytearray) -> Any:
    """A request body as JSON; ApiError (400) when it is not (see the module docstring)."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, an integer of too many digits
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid("the request body is not valid JSON: nested too deeply") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Fields:
    """A request body's fields, each read once with its type and range checked; unknown names refused up front."""

    def __init__(self, body: Any, allowed: set[str]):
        if not isinstance(body, Mapping):
            raise invalid("the request body must be a JSON object")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise invalid(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def typed(self, name: str, kind: type) -> Any:
        value = self.body.get(name)
        if value is not None and not isinstance(value, kind):
            raise invalid(f"{name} must be a {kind.__name__}", name)
        if isinstance(value, str):
            _unicode(value, name)
        return value

    def number(self, name: str, low: float, high: float) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise invalid(f"{name} must be a number in [{low:g}, {high:g}]", name)
        return float(value)

    def real(self, name: str) -> float | None:
        """A number of any value (its range is checked elsewhere)."""
        value = self.body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise invalid(f"{name} must be a number", name)
        return None if value is None else float(value)

    def integer(self, name: str, low: int, high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not _is_int(value) or value < low or (high is not None and value > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise invalid(f"{name} must be an integer {bound}", name)
        return value

    def neutral(self, name: str, allowed: Sequence[Any]) -> None:
        """A field tether does not implement: accepted only absent, null or at a value that changes nothing."""
        value = self.body.get(name)
        if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
            raise invalid(f"{name} is not supported (only {json.dumps(allowed[0])})", name)
