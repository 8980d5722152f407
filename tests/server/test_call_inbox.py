"""Rounds started straight from their frames (tether.server.call_inbox, tether.server.stream_rounds) and the session
lock that lets them (tether.server.session_lock).

What the fast way must not change: requests are taken in arrival order, each once, with credit for each; a round
taken from its frame holds back what follows it (a half-close included) until its answer is sent; anything it
declines reaches the handler, which answers as ever; through a front end, rounds one at a time and sent ahead of
their verdicts are answered exactly as in process; a failure after the start is the same inline error; a stream
cancelled mid-round leaves its session held until the round's step ends, then usable. The batcher's step is held
on an event where a test needs a round to be running; nothing waits on the clock (BOUND_S is a safety net).
"""

import asyncio
import threading
from types import SimpleNamespace

import pytest
from test_frontends import BOUND_S, Stream, fronted, models, until  # noqa: F401 (fronted and models: its fixtures)
from test_service import VOCAB, Client, open_msg, plain

from tether.server import batcher as batcher_module
from tether.server.call_inbox import CallInbox
from tether.server.session_lock import SessionLock
from tether.server.stream_rounds import StreamRounds
from tether.v1 import tether_pb2 as pb

# ---- the inbox on its own ----------------------------------------------------------------------------------------


class FakeCall:
    """What an inbox needs of its call, recorded."""

    def __init__(self, credit: int = 8):
        self.credit, self.sent, self.consumed_n = credit, [], 0

    def has_reply_credit(self) -> bool:
        return self.credit > 0

    def send_reply(self, message) -> None:
        self.credit -= 1
        self.sent.append(message)

    def consumed(self) -> None:
        self.consumed_n += 1


def round_bytes(n: int) -> bytes:
    return pb.ClientMessage(round=pb.DraftRound(round=n, root=1, tokens=[2])).SerializeToString()


OPEN = pb.ClientMessage(open=pb.OpenSession(prompt=[1])).SerializeToString()


class Taker:
    """A rounds taker that takes the rounds `accept` allows and keeps their answers to call later."""

    def __init__(self, accept=lambda req: True):
        self.accept, self.running = accept, []

    def __call__(self, req, answer) -> bool:
        if not self.accept(req):
            return False
        self.running.append((req.round, answer))
        return True

    def answer(self) -> int:
        n, answer = self.running.pop(0)
        answer(f"verdict {n}")
        return n


def test_rounds_are_taken_in_order_and_what_follows_a_running_one_waits_for_its_answer():
    async def main():
        call, take = FakeCall(), Taker()
        inbox = CallInbox(call)
        inbox.offer(OPEN)
        assert await inbox.next() == OPEN  # no taker yet: the handler reads everything
        inbox.take_rounds(take)
        reader = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0)  # the handler now waits for its next message
        inbox.offer(round_bytes(1))
        inbox.offer(round_bytes(2))  # sent ahead of round 1's verdict
        inbox.offer(None)  # and the client half-closes
        assert [n for n, _ in take.running] == [1] and inbox.taken == 1 and not reader.done()
        assert take.answer() == 1
        await asyncio.sleep(0)  # a reader given the end would be done now
        assert call.sent == ["verdict 1"] and [n for n, _ in take.running] == [2] and not reader.done()
        assert take.answer() == 2
        assert await reader is None  # the end reaches the handler only after the last verdict went out
        assert call.sent == ["verdict 1", "verdict 2"] and call.consumed_n == 4 and call.credit == 6

    asyncio.run(main())


def test_what_the_taker_declines_and_what_is_no_round_reach_the_handler_in_order():
    async def main():
        call, take = FakeCall(), Taker(accept=lambda req: req.round != 2)
        inbox = CallInbox(call)
        inbox.take_rounds(take)
        for payload in (round_bytes(1), round_bytes(2), round_bytes(3), OPEN, b"\xff not a message"):
            inbox.offer(payload)
        reader = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0)
        assert [n for n, _ in take.running] == [1] and not reader.done()  # taken at once: round 2 waits
        take.answer()
        assert await reader == round_bytes(2)  # declined: the handler's
        reader = asyncio.ensure_future(inbox.next())  # the handler is through with it and reads again
        await asyncio.sleep(0)
        assert [n for n, _ in take.running] == [3] and not reader.done()
        take.answer()
        assert await reader == OPEN
        assert await inbox.next() == b"\xff not a message"  # the handler's own parse refuses it
        assert call.sent == ["verdict 1", "verdict 3"] and call.consumed_n == 5

    asyncio.run(main())


def test_while_the_handler_is_busy_rounds_wait_for_it_and_without_reply_credit_they_go_to_it():
    async def main():
        call, take = FakeCall(credit=0), Taker()
        inbox = CallInbox(call)
        inbox.take_rounds(take)
        inbox.offer(round_bytes(1))  # nobody reads: the handler is busy with the message before
        assert not take.running and inbox.pending
        assert await inbox.next() == round_bytes(1)  # no credit for a reply: the handler waits for it
        call.credit = 1
        inbox.offer(round_bytes(2))
        reader = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0)
        assert [n for n, _ in take.running] == [2] and not reader.done()
        reader.cancel()

    asyncio.run(main())


# ---- the session lock --------------------------------------------------------------------------------------------


def test_the_session_lock_hands_over_in_order_and_try_acquire_never_barges():
    async def main():
        lock, order = SessionLock(), []
        assert lock.try_acquire() and not lock.try_acquire()

        async def handler(name):
            await lock.acquire()
            order.append(name)

        first, second = asyncio.ensure_future(handler("a")), asyncio.ensure_future(handler("b"))
        await asyncio.sleep(0)
        lock.release()  # handed to "a" at once: a try_acquire now must fail
        assert lock.locked() and not lock.try_acquire()
        await first
        third = asyncio.ensure_future(handler("c"))
        await asyncio.sleep(0)
        lock.release()
        second.cancel()  # handed over, then cancelled before it ran: "c" gets the lock
        with pytest.raises(asyncio.CancelledError):
            await second
        await third
        assert order == ["a", "c"] and lock.locked()
        lock.release()
        assert not lock.locked() and lock.try_acquire()
        with pytest.raises(RuntimeError):
            SessionLock().release()

    asyncio.run(main())


# ---- through front ends (test_frontends' service, also served in process) ------------------------------------------


@pytest.fixture
def taken(monkeypatch):
    """Counts the rounds started straight from their frames."""
    count = [0]
    real = StreamRounds.take

    def take(self, req, answer):
        ok = real(self, req, answer)
        count[0] += ok
        return ok

    monkeypatch.setattr(StreamRounds, "take", take)
    return count


@pytest.fixture
def held_step(monkeypatch):
    """The batcher's next step waits on `gate` once it has begun (`begun`)."""
    real, begun, gate = batcher_module.verify_batch, threading.Event(), threading.Event()

    def verify_batch(*args, **kwargs):
        begun.set()
        assert gate.wait(BOUND_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(batcher_module, "verify_batch", verify_batch)
    return SimpleNamespace(begun=begun, gate=gate)


def draft_round(number, root, tokens, after=0):
    return pb.ClientMessage(round=pb.DraftRound(round=number, root=root, tokens=tokens, after_length=after))


def overlapped_session(stub, target, prompt) -> list[pb.ServerMessage]:
    """Rounds one at a time, then two sent ahead of their verdicts (one guess right, one wrong), then one more."""
    g = plain(target, prompt, 12)
    n, client = len(prompt), Stream(stub)
    try:
        got = [client.send(open_msg(prompt))]
        got.append(client.send(draft_round(1, g[0], g[1:3])))
        client.outbox.put(draft_round(2, g[3], g[4:6]))
        client.outbox.put(draft_round(3, g[6], g[7:9], after=n + 6))  # right: round 2 accepts both
        client.outbox.put(draft_round(4, g[6], g[7:9], after=n + 5))  # wrong: stale, refused alone
        got += [next(client.replies) for _ in range(3)]
        got.append(client.send(draft_round(4, g[9], g[10:12])))
        return [m for m in got if m.WhichOneof("body") != "opened"]
    finally:
        client.close()


def test_rounds_through_a_front_end_start_from_their_frames_and_answer_as_in_process(fronted, taken):  # noqa: F811
    prompt = [1, 2, 3, 4, 5, 6, 0, 1]
    through = overlapped_session(fronted.stub, fronted.target, prompt)
    assert taken[0] == 4  # every round but the stale one, which its handler refused
    direct = overlapped_session(fronted.direct, fronted.target, prompt)
    assert taken[0] == 4  # in process nothing is taken from a frame
    assert [m.WhichOneof("body") for m in through] == ["verdict", "verdict", "verdict", "error", "verdict"]
    assert through[3].error.reason == pb.REASON_STALE_ROUND
    assert through == direct


def test_a_failure_after_a_round_started_is_the_same_inline_error_and_the_stream_goes_on(fronted, taken, monkeypatch):  # noqa: F811
    real = batcher_module.verify_batch

    def refused(target, items, **kwargs):
        return [ValueError("row refused")] * len(items)

    prompt = [3, 1, 4, 1, 5]
    g = plain(fronted.target, prompt, 6)
    replies = []
    for stub in (fronted.stub, fronted.direct):
        client = Stream(stub)
        client.send(open_msg(prompt))
        monkeypatch.setattr(batcher_module, "verify_batch", refused)
        replies.append(client.send(draft_round(1, g[0], g[1:3])))
        monkeypatch.setattr(batcher_module, "verify_batch", real)
        assert client.send(draft_round(1, g[0], g[1:3])).verdict.bonus == g[3]  # the same round again: it runs now
        client.close()
    assert replies[0] == replies[1] and replies[0].error.reason == pb.REASON_INVALID_REQUEST
    assert taken[0] == 2


def test_a_stream_cancelled_mid_round_keeps_its_session_held_until_the_step_ends(fronted, taken, held_step):  # noqa: F811
    prompt = [2, 7 % VOCAB, 1, 3]
    g = plain(fronted.target, prompt, 4)
    client = Client(fronted.stub)
    opened = client.send(open_msg(prompt)).opened
    session = fronted.service.engine.sessions[opened.session_id]
    client.outbox.put(draft_round(1, g[0], g[1:3]))
    assert held_step.begun.wait(BOUND_S) and taken[0] == 1
    client.replies.cancel()
    until(lambda: not any(c.calls for c in fronted.handle.host.connections.values()), "the engine's call ended")
    assert session.lock.locked()  # its round's step still runs: nobody else may use the session
    held_step.gate.set()
    until(lambda: not session.lock.locked(), "the session released once its step ended")
    again = Stream(fronted.stub)
    attach = pb.AttachSession(session_id=opened.session_id, resume_token=opened.resume_token)
    assert again.send(pb.ClientMessage(attach=attach)).attached.session_id == opened.session_id
    again.close()


def test_a_half_close_after_a_running_round_ends_the_stream_after_its_verdict(fronted, taken, held_step):  # noqa: F811
    prompt = [5, 4, 3, 2]
    g = plain(fronted.target, prompt, 4)
    client = Stream(fronted.stub)
    client.send(open_msg(prompt))
    client.outbox.put(draft_round(1, g[0], g[1:3]))
    assert held_step.begun.wait(BOUND_S)
    client.close()  # the client half-closes while its round runs

    def half_closed():
        calls = [c for conn in fronted.handle.host.connections.values() for c in conn.calls.values()]
        return calls and None in calls[0].inbox.pending

    until(half_closed, "the half-close held behind the running round")
    held_step.gate.set()
    replies = list(client.replies)
    assert [m.WhichOneof("body") for m in replies] == ["verdict"] and replies[0].verdict.bonus == g[3]
    assert taken[0] == 1
