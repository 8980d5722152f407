"""Identifiers both ends handle: session ids and resume tokens (chosen by the server), and sha256 digests.

Contract: `new_session_id()` is 128 random bits as 32 lowercase hex digits, the only shape `is_session_id`
accepts; `new_session_id(engine=k)` (a server of several engine processes) puts k in its first two digits and 120
random bits after them, and `engine_of(sid, n)` reads it back (None for a malformed id or one past n);
`is_sha256(text)` accepts exactly 64 lowercase hex digits. Anything else a peer sends in these fields
is refused before it is used: as a dictionary key, in a log line, or (digests) as a file name.

    sid = new_session_id(); assert is_session_id(sid)
"""

from __future__ import annotations

import secrets

SESSION_ID_HEX = 32  # hex digits of a session id or resume token (128 bits)
_HEX = frozenset("0123456789abcdef")


def is_hex(text: str, digits: int) -> bool:
    """Exactly `digits` lowercase hex digits."""
    return len(text) == digits and _HEX.issuperset(text)


MAX_ENGINES = 256  # engine indexes fit the id's first two hex digits


def new_session_id(engine: int | None = None) -> str:
    """A fresh id; with `engine`, the engine process that holds the session in its first two digits, so that any
    front end routes the session's later calls there without a shared table."""
    if engine is None:
        return secrets.token_hex(SESSION_ID_HEX // 2)
    if not 0 <= engine < MAX_ENGINES:
        raise ValueError(f"engine index {engine} is not in 0..{MAX_ENGINES - 1}")
    return f"{engine:02x}" + secrets.token_hex(SESSION_ID_HEX // 2 - 1)


def engine_of(session_id: str, engines: int) -> int | None:
    """The engine index `new_session_id(engine=...)` put in `session_id`; None unless it is a well-formed id of
    one of `engines` engines (a peer's text: anything else is routed as if no session were named)."""
    if not is_session_id(session_id):
        return None
    k = int(session_id[:2], 16)
    return k if k < engines else None


def is_session_id(text: str) -> bool:
    return is_hex(text, SESSION_ID_HEX)


def is_sha256(text: str) -> bool:
    return is_hex(text, 64)
