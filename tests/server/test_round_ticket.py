"""RoundTicket, the handle of a round taken from its frame: the Future subset the batcher, ModelWork and a
session's Claim rely on (never started once cancelled, callbacks once, a wait that ends)."""

import threading

from tether.server.round_ticket import RoundTicket


def test_a_cancelled_ticket_never_starts_and_tells_its_callbacks_once():
    seen = []
    t = RoundTicket()
    t.add_done_callback(seen.append)
    assert t.cancel() and t.done()
    assert not t.set_running_or_notify_cancel()
    assert not t.cancel()
    assert seen == [t]
    t.add_done_callback(seen.append)  # added after the end: runs at once
    assert seen == [t, t]


def test_a_started_ticket_cannot_be_cancelled_and_ends_when_settled():
    seen = []
    t = RoundTicket()
    t.add_done_callback(lambda x: seen.append("first"))
    assert t.set_running_or_notify_cancel()
    assert not t.cancel() and not t.done()
    t.add_done_callback(lambda x: seen.append("second"))
    assert seen == []
    t.settle()
    assert t.done() and seen == ["first", "second"]


def test_wait_returns_once_another_thread_settles_it():
    t = RoundTicket()
    assert t.set_running_or_notify_cancel()
    started, waited = threading.Event(), threading.Event()

    def waiter():
        started.set()
        t.wait()
        waited.set()

    th = threading.Thread(target=waiter)
    th.start()
    started.wait()
    assert not waited.is_set() or t.done()
    t.settle()
    th.join(timeout=30)
    assert waited.is_set()
    RoundTicket().cancel()  # a wait on an ended ticket returns at once
    ended = RoundTicket()
    ended.cancel()
    ended.wait()
