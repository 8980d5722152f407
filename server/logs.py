"""Server logging for operators: one JSON object per line (for a log pipeline), or plain text for a terminal.

Contract: `configure_logging(fmt="json"|"text", level="info")` sets up the "tether" logger tree on stderr.
In JSON each record is {"ts", "level", "logger", "msg"} plus the structured fields the call passed in `extra`
(the service passes `event`, `session` and more: a session id is the thread that ties a session's lines
together). Exceptions come as an "exc" string.
Log lines never carry a caller's text as it came: in both formats every string field and the message are cut to
FIELD_LIMIT characters and, in text, control characters are escaped (a newline in a field cannot forge a line);
JSON escapes them itself. The service logs only after authentication and validation; this is the second guard.

    configure_logging("json")
    logging.getLogger("tether.server").info("session opened", extra={"event": "open", "session": sid})
"""

from __future__ import annotations

import json
import logging
import time

from tether.shared.cli_support import StderrHandler

# Attributes every LogRecord has; anything else on a record came from `extra` and is a structured field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
FIELD_LIMIT = 256  # characters of any one string field (or message) a log line keeps


def _cut(value: object) -> object:
    if not isinstance(value, str) or len(value) <= FIELD_LIMIT:
        return value
    return f"{value[:FIELD_LIMIT]}...(+{len(value) - FIELD_LIMIT} chars)"


def _escaped(value: object) -> str:
    """One line, printable: newlines, tabs and other control characters as backslash escapes."""
    text = str(_cut(value))
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _fields(record: logging.LogRecord) -> dict:
    return {k: _cut(v) for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _cut(record.getMessage()),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={_escaped(v)}" for k, v in _fields(record).items())
        line = f"{self.formatTime(record)} {record.levelname.lower():7s} {_escaped(record.getMessage())}"
        line = f"{line}  {fields}" if fields else line
        return line + (f"\n{self.formatException(record.exc_info)}" if record.exc_info else "")


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be json or text, not {fmt!r}")
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("tether")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
