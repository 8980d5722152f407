"""Outages as a user reads them: why the link is down in a few words, and one line per change of the link's state.

Contract:
- `Cause`: why the session lost the server, typed where the error is made (tether.client.transport sets it on
  LinkDown and its kin from the gRPC status and the typed reason, never from message text). Its value is the short
  human reason: "server unreachable", "link stalled", "server full", ...
- `reason(error)`: that reason for an error the session went offline on, with the wait for a stall ("link
  stalled, no reply in 2.0 s"). The raw error (gRPC's own text) is for `--log-level debug` only.
- `LinkNotes`: one line per change of the link's state as a user sees it, from the session's events: "offline:
  server unreachable", "resyncing", "online: 40 offline tokens verified, 8 retracted". A resync attempt that does
  not reach the server (the session tries again and again while the link is down) changes nothing: the link stays
  offline, and nothing is said until the server answers (the first tokens a resync verifies or retracts, or the
  session online again). Every surface (generate's live view and plain stream, chat, the edge API's log) prints
  these lines, so they all say the same.

    notes = LinkNotes()
    for line in notes.lines(event):
        print(f"[tether: {line}]")
"""

from __future__ import annotations

from enum import StrEnum

from tether.client.session_types import Event, State


class Cause(StrEnum):
    """Why the link is down; the value is what a user reads."""

    UNREACHABLE = "server unreachable"  # UNAVAILABLE: nothing answers (refused, reset, no route)
    STALLED = "link stalled"  # no reply in time (a round, or a call's deadline)
    CLOSED = "the server closed the stream"
    BROKEN = "connection broken"  # a transfer broken mid-way
    FAILED = "link failed"  # another transient status (CANCELLED, ABORTED, INTERNAL, UNKNOWN)
    BUSY = "server full"  # the server refused for load (its retry advice is followed)
    INVALID = "invalid reply from the server"  # a message the session refused: the round is lost
    SESSION_LOST = "the server lost the session"  # restart, eviction, another replica: resync rebuilds it
    SESSION_FULL = "the server session is full"  # no room left in it: resync rebuilds one


def reason(error: BaseException) -> str:
    """The short human reason for an error the session went offline on (its Cause; FAILED for an untyped one)."""
    cause = getattr(error, "cause", Cause.FAILED)
    waited = getattr(error, "waited_s", 0.0)
    if cause == Cause.STALLED and waited:
        return f"{cause.value}, no reply in {waited:.1f} s"
    return cause.value


class LinkNotes:
    """The lines to show for a session's events: one per change of the link's state (see the module docstring).
    One per generation (a chat reply, an edge API request): it starts online."""

    def __init__(self) -> None:
        self.shown = State.ONLINE  # the link's state as last told
        self.attempt = False  # a resync attempt started and the server has not answered it yet
        self.verified = self.retracted = 0  # offline tokens the resyncs of this outage decided on

    def lines(self, e: Event) -> list[str]:
        if e.kind == "state":
            return self._state(e)
        if e.kind in ("verify", "retract") or (e.kind == "tokens" and e.tag == "verified"):
            out = self._answered()
            self.verified += e.count if e.kind == "verify" else 0
            self.retracted += e.count if e.kind == "retract" else 0
            return out
        return []

    def _answered(self) -> list[str]:
        """The server answered a resync attempt: the link is resyncing, said once."""
        if not self.attempt:
            return []
        self.attempt = False
        self.shown = State.RESYNCING
        return ["resyncing"]

    def _state(self, e: Event) -> list[str]:
        if e.state == State.RESYNCING:
            self.attempt = True  # said once the server answers (_answered): an unreachable one changes nothing
            return []
        if e.state == State.OFFLINE:
            self.attempt = False
            if self.shown == State.OFFLINE:
                return []
            self.shown = State.OFFLINE
            return ["offline: " + (e.detail or "link down")]
        if e.state == State.ONLINE and self.shown != State.ONLINE:
            out = self._answered()
            self.shown = State.ONLINE
            decided = [f"{self.verified} offline tokens verified"] if self.verified else []
            decided += [f"{self.retracted} retracted"] if self.retracted else []
            decided += [e.detail] if e.detail else []
            self.verified = self.retracted = 0  # the outage is over: the next one counts its own
            return [*out, "online" + (": " + ", ".join(decided) if decided else " again")]
        return []
