"""Text in and out of an edge session, as its callers do it (tether-client, chat, the edge API): the session takes
and yields token ids, and the tokenizer pairing brings encodes the prompt and decodes the continuation.

- `run_text(session, text)` -> Result: pairs the session if it has not paired yet, then runs it after `text`.
- `generate_text(cfg, text, on_event)` -> Result: one session, run after `text` to the end, closed.
- `continuation(session, result)` -> str: the text the result adds to its prompt, without the ids it ended at.
"""

from __future__ import annotations

from collections.abc import Callable

from tether.client.session import ClientConfig, EdgeSession, Event, Result


def run_text(session: EdgeSession, text: str) -> Result:
    if session.models is None:
        session.pair()
    return session.run(session.models.tokenizer.encode(text))


def generate_text(cfg: ClientConfig, text: str, on_event: Callable[[Event], None] | None = None) -> Result:
    session = EdgeSession(cfg, on_event)
    try:
        return run_text(session, text)
    finally:
        session.close()


def continuation(session: EdgeSession, result: Result) -> str:
    return result.continuation(session.models.tokenizer, session.stop_ids or ())
