"""How the edge client tells an outage, without a server: the typed reason of each way the link fails, one line per
change of the link's state (tether.client.outage.LinkNotes) in every surface (the plain stream, a chat's, the live
view, the edge API's log), the tokens a resync kept turning verified there, the edge API's answer while the server
cannot be reached, time to first token from the command's start, and --log-level."""

import io
import logging
import threading

import grpc
import pytest
from rich.console import Console
from toy_models import toy_model_dir

from tether.client.cli import main
from tether.client.edge_api import Release, api_error
from tether.client.live_view import LiveView, PlainStream, summary_line
from tether.client.logs import LogConfig, configure
from tether.client.outage import Cause, LinkNotes, reason
from tether.client.refusals import Refusal
from tether.client.session_types import Event, Result, State, Stats
from tether.client.transport import LinkDown, ServerBusy, SessionFull, SessionLost, SessionStream, refused
from tether.shared.openai_api import ErrorKind, Tokens
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb

RAW = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:9: Connection refused"


def state(s: State, detail: str = "") -> Event:
    return Event("state", state=s, detail=detail)


def tokens(ids, tag: str) -> Event:
    return Event("tokens", tokens=list(ids), tag=tag)


# An outage as the session reports it: three resync attempts the unreachable server never answers, then one that
# keeps 3 of 5 offline tokens (rewind), the target's token, online again.
OUTAGE = [
    tokens([1, 2], "verified"),
    state(State.OFFLINE, "server unreachable"),
    tokens([3], "offline"),
    state(State.RESYNCING),
    state(State.OFFLINE, "server unreachable"),
    tokens([4, 5], "offline"),
    state(State.RESYNCING),
    state(State.OFFLINE, "link stalled, no reply in 2.0 s"),
    tokens([6, 7], "offline"),
    state(State.RESYNCING),
    Event("verify", start=2, count=3),
    Event("retract", count=2),
    tokens([9], "verified"),
    state(State.ONLINE),
    tokens([10], "verified"),
]
LINES = ["offline: server unreachable", "resyncing", "online: 3 offline tokens verified, 2 retracted"]


class FakeCall:
    """A Session call that never answers, until cancelled."""

    def __init__(self):
        self.cancelled = threading.Event()

    def __iter__(self):
        self.cancelled.wait()
        return iter(())

    def cancel(self):
        self.cancelled.set()


class FakeStub:
    def Session(self, requests, metadata):  # noqa: N802 (gRPC's method name)
        return FakeCall()


# ---- the reason, typed where the error is made -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (refused(Refusal(grpc.StatusCode.UNAVAILABLE, pb.REASON_UNSPECIFIED, RAW)), "server unreachable"),
        (refused(Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, pb.REASON_UNSPECIFIED, "Deadline Exceeded")),
         "link stalled"),
        (refused(Refusal(grpc.StatusCode.INTERNAL, pb.REASON_UNSPECIFIED, "RST_STREAM")), "link failed"),
        (refused(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY, "no room", 1.0)), "server full"),
        (refused(Refusal(grpc.StatusCode.NOT_FOUND, pb.REASON_UNKNOWN_SESSION, "gone")), "the server lost the session"),
        (refused(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_SESSION_FULL, "full")),
         "the server session is full"),
        (LinkDown("no answer within 2.0 s", cause=Cause.STALLED, waited_s=2.0), "link stalled, no reply in 2.0 s"),
        (RuntimeError("untyped"), "link failed"),
    ],
)  # fmt: skip
def test_each_failure_has_a_short_typed_reason_and_never_grpcs_text(error, text):
    assert reason(error) == text
    assert isinstance(error, LinkDown | SessionLost | RuntimeError)


def test_a_round_unanswered_in_time_is_a_stall_with_its_wait():
    stream = SessionStream(FakeStub(), ())
    try:
        with pytest.raises(LinkDown) as raised:
            stream.receive(0.2)
    finally:
        stream.close()
    assert raised.value.cause is Cause.STALLED and reason(raised.value) == "link stalled, no reply in 0.2 s"


def test_the_kinds_of_the_session_loop_keep_their_causes():
    busy = ServerBusy(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY, "x", 1.0))
    assert busy.cause is Cause.BUSY and SessionFull("x").cause is Cause.SESSION_FULL
    assert LinkDown("x").cause is Cause.FAILED


# ---- one line per change of the link's state ---------------------------------------------------------------------


def notes(events: list[Event]) -> list[str]:
    n = LinkNotes()
    return [line for e in events for line in n.lines(e)]


def test_failed_resync_attempts_and_another_reason_while_offline_change_nothing():
    assert notes(OUTAGE) == LINES


def test_a_resync_the_link_breaks_after_the_server_answered_is_two_changes():
    events = [state(State.OFFLINE, "server unreachable"), state(State.RESYNCING), Event("verify", start=0, count=4),
              state(State.OFFLINE, "server unreachable"), state(State.RESYNCING), state(State.ONLINE)]  # fmt: skip
    assert notes(events) == ["offline: server unreachable", "resyncing", "offline: server unreachable", "resyncing",
                             "online: 4 offline tokens verified"]  # fmt: skip


def test_connecting_and_a_chats_turn_say_nothing():
    events = [state(State.CONNECTING), state(State.ONLINE), tokens([1], "verified"), state(State.CONNECTING),
              state(State.ONLINE), state(State.DONE)]  # fmt: skip
    assert notes(events) == []


def test_a_rebuilt_session_says_so_when_online_again():
    events = [state(State.OFFLINE, "the server lost the session"), state(State.RESYNCING),
              state(State.ONLINE, "session rebuilt")]  # fmt: skip
    assert notes(events) == ["offline: the server lost the session", "resyncing", "online: session rebuilt"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(toy_model_dir() / "tokenizer.json")


def test_the_plain_stream_and_a_chats_notes_are_those_lines(tok):
    out, err = io.StringIO(), io.StringIO()
    stream = PlainStream(tok, out=out, err=err)
    for e in OUTAGE:
        stream.on_event(e)
    notes_said = [line.strip("[]").removeprefix("tether: ") for line in err.getvalue().split("\n") if line]
    assert notes_said == [LINES[0], LINES[1], "rewound 2 offline tokens; the text goes on from there", LINES[2]]


def test_the_live_view_logs_those_lines_and_turns_kept_tokens_verified(tok):
    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    view = LiveView(tok, "x", console=console)
    with view:
        for e in OUTAGE:
            view.on_event(e)
    assert [line.split("s  ", 1)[1] for line in view.log] == LINES
    assert view.tokens == [1, 2, 3, 4, 5, 9, 10] and view.tags == ["verified"] * 7


# ---- the edge API ------------------------------------------------------------------------------------------------


def test_rewind_sends_what_a_final_resync_kept_as_verified_with_no_token_after_it():
    # The generation was full offline: the resync keeps all 3 and the target's next token is past the limit.
    sent: list[Tokens] = []
    release = Release(True, sent.append)
    for e in [tokens([1], "verified"), state(State.OFFLINE, "server unreachable"), tokens([2, 3, 4], "offline"),
              state(State.RESYNCING), Event("verify", start=1, count=3), state(State.ONLINE)]:  # fmt: skip
        release.event(e)
    release.end()
    assert sent == [Tokens([1]), Tokens([2, 3, 4])]


@pytest.mark.parametrize(
    "error",
    [refused(Refusal(grpc.StatusCode.UNAVAILABLE, pb.REASON_UNSPECIFIED, RAW)), SessionLost("unknown session")],
)
def test_an_unreachable_server_is_its_own_503_with_the_reason_and_retry_after(error):
    e = api_error(error, "10.0.0.1:50051")
    body = e.body()["error"]
    assert e.kind is ErrorKind.UNREACHABLE and e.kind.status == 503 and e.headers()["Retry-After"] == "2"
    assert body["code"] == "server_unreachable" and body["message"] == reason(error) and RAW not in body["message"]
    busy = api_error(ServerBusy(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY, "x", 3.0)), "s")
    assert busy.kind is ErrorKind.OVERLOADED  # a server that refuses for load stays "overloaded"


# ---- time to first token, and --log-level ------------------------------------------------------------------------


def test_time_to_first_token_from_the_commands_start_and_after_pairing(tok):
    stats = Stats()
    stats.token_emitted(1, start=10.0, now=10.015, began=8.5)
    stats.token_emitted(1, start=10.0, now=10.5, began=8.5)
    assert stats.ttft_s == pytest.approx(0.015) and stats.ttft_from_start_s == pytest.approx(1.515)
    line = summary_line(Result([1], [2, 3], ["verified"] * 2, stats))
    assert "first token 1515 ms (15 ms after pairing)" in line
    plain = Stats()
    plain.token_emitted(1, start=10.0, now=10.2)
    assert plain.ttft_from_start_s == plain.ttft_s  # a session no command started: from the prompt


def test_log_level_debug_lets_the_raw_text_through_and_warning_does_not(capsys):
    log, tether = logging.getLogger("tether.client"), logging.getLogger("tether")
    handlers = list(tether.handlers)
    try:
        configure(LogConfig(log_level="debug"))
        log.debug("offline: %s", RAW)
        configure(LogConfig(log_level="warning"))
        log.debug("offline: %s", "not shown")
    finally:
        tether.handlers[:] = handlers
        tether.setLevel(logging.NOTSET)
    err = capsys.readouterr().err
    assert RAW in err and "not shown" not in err
    with pytest.raises(ValueError):
        configure(LogConfig(log_level="loud"))


@pytest.mark.parametrize(("argv", "default"), [(["generate"], "warning"), (["chat"], "warning"), (["serve"], "info")])
def test_every_command_that_talks_to_a_server_takes_log_level(argv, default, capsys):
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--log-level {debug,info,warning,error}" in out and f"(default: {default})" in out
