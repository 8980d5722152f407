"""The session file: the record of one generation, saved as it goes, from which a killed client resumes.

The client never depends on the server's memory for its text (docs/ARCHITECTURE.md, section 7): tokens, tags and
the verified length are its own, and this record keeps them across a restart. The session (tether.client.session)
saves it at every consistent point (the root emitted), and a restarted client given the same file loads it and
goes on from it: a new server session over the verified history, then a resync of the rest, as after an outage.

Contract:
- `SessionRecord`: the server list and the model fingerprint it was written for, the server session's id and
  resume token, the prompt, the tokens and their tags, the verified length, and whether the generation is done.
- `save_record(path, record)` replaces the file atomically (a client killed mid-write leaves the previous record)
  and keeps it owner-only from its first byte, whatever the umask and whatever a killed client left behind as
  `path.tmp`: the resume token proves ownership of the server's session.
- `load_record(path, model_fingerprint)` -> the record, or None when there is no file; a record written for
  another model than the server's raises ServerError (FAILED_PRECONDITION): resuming it would mix two models' text.

    save_record(path, SessionRecord(server, fp, session_id, token, prompt, tokens, tags, verified, done=False))
    record = load_record(path, info.model_fingerprint)

Tests: tests/client/test_session_file.py (modes), tests/e2e/test_client_restart.py (a client killed and resumed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from tether.client.transport import ServerError


@dataclass(frozen=True)
class SessionRecord:
    server: str  # the --server list it was written with
    model_fingerprint: str  # the server's model then: a record for another model is refused
    session_id: str  # the server session, closed on resume ("" before one was opened)
    resume_token: str  # proves ownership of that session: the reason the file is owner-only
    prompt: list[int]
    tokens: list[int]  # generated and emitted, the root included
    tags: list[str]  # "verified" or "offline", one per token
    verified: int  # positions (prompt included) whose states the server verified
    done: bool  # the generation ended: a restarted client reports it and stops


def save_record(path: str | os.PathLike, record: SessionRecord) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    # Owner-only from the first byte; fchmod too, for a tmp file a killed client left behind with other permissions.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(json.dumps(dataclasses.asdict(record)))
    tmp.replace(path)  # atomic: a client killed mid-write leaves the previous record


def load_record(path: str | os.PathLike, model_fingerprint: str) -> SessionRecord | None:
    path = Path(path)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    record = SessionRecord(**{f.name: raw[f.name] for f in dataclasses.fields(SessionRecord)})
    if record.model_fingerprint != model_fingerprint:
        message = f"{path} was written for another model than the server's"
        raise ServerError(grpc.StatusCode.FAILED_PRECONDITION, message)
    return record
