"""One request of the OpenAI-compatible API (tether.shared.openai_app) from its first token to its last: its n
choices, streamed as server-sent events or answered as one body.

Contract:
- `Completion(app, req, model, prompt, max_tokens, record)` holds req.n of the app's generation slots (`app.live`,
  one per choice) from construction until `close()`; choice i is the backend's generation with the request's
  sampling and seed + i (mod 2^64), so n = 1 is what it has always been. `start()` waits for every choice's first
  chunk (the prefill), so a refusal is still the response's status. `events()` yields the SSE frames: for a chat,
  each choice's role chunk; then every choice's text pieces as they come (n > 1: interleaved, each chunk naming its
  choice's index), each choice's finish chunk as it ends, the usage chunk when asked, `data: [DONE]`; a refusal
  mid-stream is an error event. `respond(request)` is the whole body, or a 499 when the client goes away first.
  Either way every choice's generation is closed when it ends, or at once when the client goes away.
- A choice's text is tether.shared.text_stream's TextStream (stop strings, stop ids, hidden special tokens). With
  Sampling.logprobs each consumed token's log-probabilities, as the backend reported them (Tokens.logprobs), go
  with the text of the chunk that consumed it, in chat's or completions' shape (openai_responses.chat_logprobs /
  completion_logprobs; a token's text is its own decode). A backend that reports none when asked is refused at
  start, a 400 naming logprobs. Entries a backend marks as its drafter's (Tokens.drafter_logprobs) are named in
  the choice's tether extension (openai_responses.with_offline).
- `EventStream` is the SSE response: its generator is closed however the response ends, and it ends when the
  client stops reading for `send_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tether.shared.chat_template import ChatFormat
from tether.shared.http_observe import RequestRecord
from tether.shared.openai_api import ApiError, GenerationRequest, Sampling, Tokens, invalid
from tether.shared.openai_responses import (
    SSE_DONE,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_delta,
    chat_logprobs,
    completion_body,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    sse,
    usage,
    with_offline,
)
from tether.shared.sampling import TokenLogprobs
from tether.shared.text_stream import TextStream

log = logging.getLogger("tether.http")


class Backend(Protocol):
    """What the app serves (tether.shared.openai_app documents the contract): one model's generations."""

    model_id: str  # the one model served, as /v1/models lists it
    chat: ChatFormat  # its tokenizer and chat template
    max_context: int  # positions a sequence may hold: prompt + completion
    max_prompt_tokens: int  # longest prompt accepted
    max_new_tokens: int  # most completion tokens per request
    drafts_offline: bool  # True: chunks may be marked offline, and every choice carries the "tether" field

    def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int) -> AsyncIterator[Tokens]: ...


class App(Protocol):
    """What a generation needs of the app that runs it (tether.shared.openai_app.OpenAIApp): its backend, its count
    of live generations (each choice holds one while it runs) and a token's own text."""

    backend: Backend
    live: int

    def token_text(self, token: int) -> str: ...


class Choice:
    """One choice's generation: holds one of the app's slots from construction until `close`."""

    def __init__(self, app: App, req: GenerationRequest, index: int, prompt: list[int], max_tokens: int):
        chat = app.backend.chat
        self.app, self.req, self.index, self.max_tokens = app, req, index, max_tokens
        # The request's stop tokens end it even with ignore_eos; their text is left out, as vLLM leaves it.
        stop_ids = (frozenset() if req.sampling.ignore_eos else chat.stop_ids) | frozenset(req.sampling.stop_token_ids)
        # A completion continues its prompt's text (its first space kept); a chat's reply starts a new turn.
        self.text = TextStream(
            chat.tokenizer,
            req.stop,
            stop_ids=stop_ids,
            hidden_ids=chat.hidden_ids | chat.stop_ids,
            context=() if req.chat else prompt,
        )
        self.finish = "length"
        self.first = Tokens([])
        self.offline_tokens = 0  # tokens consumed that were made offline
        self._offline_unsent = 0  # of those, the ones no streamed chunk has counted yet
        self.logprobs: list[TokenLogprobs] = []  # every consumed token's, when the request asked
        self.drafted: list[bool] = []  # of those, which are the edge drafter's own (Tokens.drafter_logprobs)
        self._logprobs_sent = 0  # of those, the ones streamed chunks carried
        self._chars_sent = 0  # characters of the tokens' own texts streamed (completions' text_offset)
        app.live += 1
        self._closed = False
        sampling = req.sampling
        if index:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % (1 << 64))
        self.chunks = app.backend.generate(prompt, sampling, max_tokens)

    async def start(self) -> None:
        """Wait for the first chunk (the prefill): a refusal here is still the response's status."""
        try:
            self.first = await anext(self.chunks)
        except StopAsyncIteration:
            self.first = Tokens([])
        except BaseException:
            await self.close()
            raise
        if self.req.sampling.logprobs is not None and self.first.ids and self.first.logprobs is None:
            await self.close()
            raise invalid("logprobs are not reported by this endpoint", "logprobs")

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.app.live -= 1
            await self.chunks.aclose()

    async def pieces(self) -> AsyncIterator[str]:
        """The choice's text as it is decided (with logprobs, a piece per token, "" for one that shows nothing
        yet); `finish` is "stop" or "length" once it ends."""
        chunk, reporting = self.first, self.req.sampling.logprobs is not None
        while True:
            self._count_verified(chunk)
            for j, token in enumerate(chunk.ids):
                piece = self.text.push(token)
                if chunk.offline:
                    self.offline_tokens += 1
                    self._offline_unsent += 1
                if reporting and chunk.logprobs is not None:
                    self.logprobs.append(chunk.logprobs[j])
                    self.drafted.append(chunk.drafter_logprobs)
                if piece or reporting:
                    yield piece
                if self.text.finish_reason is not None or self.text.tokens >= self.max_tokens:
                    break
            if self.text.finish_reason is not None:
                self.finish = "stop"
                return
            if self.text.tokens >= self.max_tokens:
                break
            try:
                chunk = await anext(self.chunks)
            except StopAsyncIteration:
                break
        tail = self.text.flush()
        self.finish = "stop" if self.text.finish_reason is not None else "length"
        if tail:
            yield tail

    def _count_verified(self, chunk: Tokens) -> None:
        """Offline tokens a resync kept are verified now: counted offline no longer (a streamed chunk that already
        counted them stands, as it was true when sent)."""
        if chunk.verified:
            self.offline_tokens -= min(chunk.verified, self.offline_tokens)
            self._offline_unsent -= min(chunk.verified, self._offline_unsent)

    async def settle(self) -> None:
        """After the last token: the chunks the backend still yields (its final resync's verdict) for the counts."""
        if self.app.backend.drafts_offline and self.offline_tokens and self.text.finish_reason is None:
            with contextlib.suppress(ApiError):
                async for chunk in self.chunks:
                    self._count_verified(chunk)

    def _logprobs_body(self, entries: list[TokenLogprobs], offset: int) -> dict | None:
        if self.req.sampling.logprobs is None:
            return None
        text_of = self.app.token_text
        return chat_logprobs(entries, text_of) if self.req.chat else completion_logprobs(entries, text_of, offset)

    def chunk(self, text: str, finish: str | None = None, role: bool = False) -> dict:
        """A streamed chunk's choice: `text` and the logprobs of the tokens consumed since the chunk before."""
        entries, drafted = self.logprobs[self._logprobs_sent :], self.drafted[self._logprobs_sent :]
        self._logprobs_sent = len(self.logprobs)
        logprobs = self._logprobs_body(entries, self._chars_sent)
        self._chars_sent += sum(len(self.app.token_text(e.token)) for e in entries)
        if self.req.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text or not finish else {}
            choice = chat_delta(self.index, delta, finish, logprobs)
        else:
            choice = completion_choice(self.index, text, finish, logprobs)
        if self.app.backend.drafts_offline:
            choice, self._offline_unsent = with_offline(choice, self._offline_unsent, self._drafted(drafted)), 0
        return choice

    def _drafted(self, drafted: list[bool]) -> list[int] | None:
        """The indices of the drafter's own logprobs among a choice's entries (None: no logprobs asked)."""
        return None if self.req.sampling.logprobs is None else [i for i, d in enumerate(drafted) if d]

    def whole(self, text: str) -> dict:
        """The choice of a whole body: its text and every consumed token's logprobs."""
        logprobs = self._logprobs_body(self.logprobs, 0)
        if self.req.chat:
            choice = chat_choice(self.index, text, self.finish, logprobs)
        else:
            choice = completion_choice(self.index, text, self.finish, logprobs)
        if not self.app.backend.drafts_offline:
            return choice
        return with_offline(choice, self.offline_tokens, self._drafted(self.drafted))


class Completion:
    """One request's n choices (see the module docstring)."""

    def __init__(
        self, app: App, req: GenerationRequest, model: str, prompt: list[int], max_tokens: int, record: RequestRecord
    ):
        self.app, self.req, self.model, self.prompt = app, req, model, prompt
        self.rid = ("chatcmpl-" if req.chat else "cmpl-") + secrets.token_hex(12)
        self.record = record
        record.session = self.rid
        self.created = int(time.time())
        self.choices: list[Choice] = []
        try:
            for i in range(req.n):
                self.choices.append(Choice(app, req, i, prompt, max_tokens))
        except BaseException:
            for c in self.choices:  # their generations have not started: closing one only gives its slot back
                c.app.live -= 1
            raise

    async def start(self) -> None:
        tasks = [asyncio.ensure_future(c.start()) for c in self.choices]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # the others stop before their generations are closed
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            raise
        self.record.first_token()

    async def close(self) -> None:
        for c in self.choices:
            await c.close()
        self.record.completion_tokens = sum(c.text.tokens for c in self.choices)

    def _usage(self) -> dict:
        return usage(len(self.prompt), sum(c.text.tokens for c in self.choices))

    def _sse(self, choice: dict | None) -> bytes:
        build = chat_chunk if self.req.chat else completion_chunk
        body = build(self.rid, self.created, self.model, choice)
        if self.req.include_usage:
            body["usage"] = self._usage() if choice is None else None
        return sse(body)

    async def _pieces(self) -> AsyncIterator[tuple[Choice, str | None]]:
        """(choice, piece) as the choices decide them, then (choice, None) once that choice has ended. One choice is
        read in place; several each on a task, through a queue as short as their number (a slow reader holds them
        all back, as it holds one)."""
        if len(self.choices) == 1:
            async for piece in self.choices[0].pieces():
                yield self.choices[0], piece
            yield self.choices[0], None
            return
        queue: asyncio.Queue = asyncio.Queue(len(self.choices))

        async def run(c: Choice) -> None:
            try:
                async for piece in c.pieces():
                    await queue.put((c, piece))
                await queue.put((c, None))
            except Exception as e:  # the consumer raises it (an ApiError: the stream's error event)
                await queue.put((c, e))

        tasks = [asyncio.ensure_future(run(c)) for c in self.choices]
        try:
            for _ in range(len(self.choices)):
                while (item := await queue.get())[1] is not None:
                    if isinstance(item[1], Exception):
                        raise item[1]
                    yield item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # before any choice's generation is closed

    async def events(self) -> AsyncIterator[bytes]:
        try:
            if self.req.chat:
                for c in self.choices:
                    yield self._sse(c.chunk("", role=True))
            async for c, piece in self._pieces():
                yield self._sse(c.chunk(piece) if piece is not None else c.chunk("", c.finish))
            if self.req.include_usage:
                yield self._sse(None)
        except ApiError as e:  # the backend ran out of room mid-stream: say so in the stream, as vLLM does
            yield sse(e.body())
        finally:
            await self.close()
        yield SSE_DONE

    async def respond(self, request: Request) -> Response:
        """The whole completion as one JSON body; the generations are closed at once if the client goes away."""

        async def whole(c: Choice) -> str:
            text = "".join([piece async for piece in c.pieces()])
            await c.settle()
            return text

        texts_task = asyncio.ensure_future(asyncio.gather(*(whole(c) for c in self.choices)))
        gone_task = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({texts_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
            if not texts_task.done():
                return Response(status_code=499)  # nobody is listening; the status is for the access log only
            texts = texts_task.result()
        finally:
            for task in (texts_task, gone_task):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await texts_task
            await self.close()
        build = chat_body if self.req.chat else completion_body
        choices = [c.whole(text) for c, text in zip(self.choices, texts, strict=True)]
        return JSONResponse(build(self.rid, self.created, self.model, choices, self._usage()))


class _StalledReader(Exception):
    """The client stopped reading a stream: a send waited past send_timeout_s."""


class EventStream(StreamingResponse):
    """An SSE response whose generator is closed however the response ends (a disconnect cancels the sending
    task while the generator waits at a yield, where nothing else would close it until garbage collection), and
    ends when the client stops reading: a connection that is open but not read would hold its generation (and its
    KV and a max_streams slot) for as long as the client likes."""

    def __init__(self, content, send_timeout_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        async def sending(message) -> None:
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _StalledReader from None

        try:
            await super().__call__(scope, receive, sending)
        except _StalledReader:
            log.info(
                "%s: the client stopped reading its stream for %g s: generation closed",
                scope["path"],
                self.send_timeout_s,
            )
        finally:
            await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
