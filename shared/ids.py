"""Identifiers both ends handle: session ids and resume tokens (chosen by the server), and sha256 digests.

Contract: `new_session_id()` is 128 random bits as 32 lowercase hex digits, the only shape `is_session_id`
accepts; `is_sha256(text)` accepts exactly 64 lowercase hex digits. Anything else a peer sends in these fields
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


def new_session_id() -> str:
    return secrets.token_hex(SESSION_ID_HEX // 2)


def is_session_id(text: str) -> bool:
    return is_hex(text, SESSION_ID_HEX)


def is_sha256(text: str) -> bool:
    return is_hex(text, 64)
