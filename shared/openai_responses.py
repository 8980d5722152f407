"""The OpenAI-compatible API's response bodies: choices, whole bodies, streamed chunks, usage, logprobs in each
endpoint's shape, tether's one extension, and server-sent events framing. Plain dicts, ready for json.dumps.

Contract:
- `completion_choice`, `chat_choice`, `chat_delta` build one choice, `completion_body`, `chat_body`,
  `completion_chunk`, `chat_chunk`, `usage` the JSON bodies around them; `chat_logprobs` and `completion_logprobs` a
  choice's logprobs in each endpoint's shape (from tether.shared.sampling.TokenLogprobs, a backend's
  `Tokens.logprobs`); `sse(obj)` and `SSE_DONE` frame a stream.
- `with_offline(choice, n, drafter_logprobs)`: tether's one extension of OpenAI's schema, for a backend that drafts
  offline (the edge's): the choice (of a body or a chunk) carries `"tether": {"offline_tokens": n}`, the number of
  completion tokens behind that choice's text that were made offline and not verified (in a stream: since the chunk
  before, so they add up to the body's count), and when logprobs were asked `"drafter_logprobs": [i, ...]`, the
  indices of the choice's logprobs entries (in a stream: the chunk's) whose values are the edge drafter's own
  (`Tokens.drafter_logprobs`: tokens drafted offline, which the target never scored; they stay numbers, as OpenAI's
  schema has them). Clients that do not know it ignore it (the openai package keeps unknown fields as extras).

Torch- and gRPC-free: the server's HTTP API and the edge endpoint use it alike (tether.shared.openai_generation).

    sse(chat_chunk(rid, created, model, chat_delta(0, {"content": "Hi"})))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from tether.shared.sampling import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish,
    }


def chat_delta(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def completion_body(rid: str, created: int, model: str, choices: list[dict], used: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": used,
    }


def chat_body(rid: str, created: int, model: str, choices: list[dict], used: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": used,
    }


def completion_chunk(rid: str, created: int, model: str, choice: dict | None) -> dict:
    """A streamed piece of one choice (completion_choice); None: the usage-only last chunk (no choices)."""
    choices = [] if choice is None else [choice]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}


def chat_chunk(rid: str, created: int, model: str, choice: dict | None) -> dict:
    """A streamed piece of one choice's message (chat_delta); None: the usage-only last chunk (no choices)."""
    choices = [] if choice is None else [choice]
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}


def chat_logprobs(entries: Sequence[TokenLogprobs], text_of: Callable[[int], str]) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}, each
    token's text by `text_of` (its decoded text; bytes are that text's UTF-8)."""

    def one(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprobs], text_of: Callable[[int], str], offset: int) -> dict:
    """Completions' `logprobs`: parallel lists of the tokens' texts, logprobs, top {text: logprob} and offsets in
    the choice's text (from `offset`: the length of its text before these tokens, each token's text counted)."""
    texts = [text_of(e.token) for e in entries]
    offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def with_offline(choice: dict, offline_tokens: int, drafter_logprobs: list[int] | None = None) -> dict:
    """`choice` with tether's extension: how many of the choice's tokens were made offline, and with logprobs, the
    indices of its logprobs entries (chat's content, completions' tokens) that are the drafter's own."""
    choice["tether"] = {"offline_tokens": offline_tokens}
    if drafter_logprobs is not None:
        choice["tether"]["drafter_logprobs"] = drafter_logprobs
    return choice


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
