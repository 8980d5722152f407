"""A front-end call's requests on the engine, in order: to the call's handler, or, for a Session stream whose
handler is waiting for its next message, a round started straight from its frame (tether.server.stream_rounds).

Why: a round that crosses a queue, the handler's coroutine and its generators costs the engine's one event loop
about twice what the round itself needs (issue #44). Streams spend most of their life in rounds, one at a time
or one sent ahead of its verdict, so most rounds can start from the callback that read their frame.

Contract (all on the engine's event loop; tether.server.frontend_host.EngineCall owns one per call):
- `CallInbox(call)`: `offer(payload)` takes each request frame's bytes as it arrives (None: the client half-closed).
  `await next()` is the handler's read: the oldest request nobody has taken (None: the end). Requests are taken
  strictly in arrival order, each once, by the handler or by the rounds taker, and `call.consumed()` is told of
  each as it is taken (flow-control credit goes back to the front end).
- `take_rounds(take)`: the Session handler hands over its stream's `StreamRounds.take` once it has a session
  (CALL_INBOX is the handler's way to its call's inbox). From then on, while the handler waits for its next
  message and no round taken here is unanswered, the oldest request, if it is a round and the call has reply
  credit left (nothing else replies meanwhile: its answer will have it), is offered to `take`; a round it takes
  holds back every later request until its answer is sent (a half-close included, so the stream's end follows its
  last verdict). Whatever `take` declines, and anything but a round, goes to the handler, which answers it as ever.
- What it needs of its call is `InboxCall`: the handler's reply credit, sending a reply, and the consumed count.

    inbox = CallInbox(call)
    inbox.offer(payload)                 # from the frame reader
    payload = await inbox.next()         # the handler's read
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from tether.v1 import tether_pb2 as pb


class InboxCall(Protocol):
    def has_reply_credit(self) -> bool: ...  # a reply may be sent now (only the handler or a taken round sends)
    def send_reply(self, message: Any) -> None: ...  # send a reply, taking its credit
    def consumed(self) -> None: ...  # one request taken: credit goes back to the front end when due


RoundTaker = Callable[[pb.DraftRound, Callable[[Any], None]], bool]

CALL_INBOX: contextvars.ContextVar[CallInbox | None] = contextvars.ContextVar("tether_call_inbox", default=None)


class CallInbox:
    def __init__(self, call: InboxCall):
        self.call = call
        self.pending: collections.deque[bytes | None] = collections.deque()  # arrived, not taken, oldest first
        self.reader: asyncio.Future | None = None  # the handler's read in progress
        self.take: RoundTaker | None = None
        self.running = False  # a round taken here has not been answered
        self.taken = 0  # rounds taken here (tests and benches read it)

    def take_rounds(self, take: RoundTaker) -> None:
        self.take = take

    def offer(self, payload: bytes | None) -> None:
        self.pending.append(payload)
        self._pump()

    async def next(self) -> bytes | None:
        self.reader = asyncio.get_running_loop().create_future()
        self._pump()
        try:
            return await self.reader
        finally:
            self.reader = None

    def _pump(self) -> None:
        """Hand out the oldest requests while someone can take them: a round to `take`, the rest to the reader."""
        while self.pending and not self.running and self.reader is not None and not self.reader.done():
            payload = self.pending.popleft()
            self.call.consumed()
            if payload is not None and self._start(payload):
                continue
            self.reader.set_result(payload)
            return

    def _start(self, payload: bytes) -> bool:
        if self.take is None or not self.call.has_reply_credit():
            return False
        try:
            message = pb.ClientMessage.FromString(payload)
        except DecodeError:
            message = None  # the handler's own parse refuses it
        if message is None or message.WhichOneof("body") != "round" or not self.take(message.round, self._answer):
            return False
        self.running = True
        self.taken += 1
        return True

    def _answer(self, reply: Any) -> None:
        self.running = False
        self.call.send_reply(reply)
        self._pump()
