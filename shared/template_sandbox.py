"""Chat templates rendered in a worker process, under bounds of time, memory and output size.

Why a process: a chat template is code from outside (a model's files; at the edge, the server's ModelInfo), and
Jinja's sandbox stops it reaching Python's internals but not from spending: `'x' * 10**10`, `10 ** 10 ** 10`,
nested `range` loops, or a `{% set s = s ~ s %}` doubling in a loop take any amount of memory or time, and a render
on a thread cannot be stopped. Counting loop iterations or output in a custom `finalize` misses most of these (one
expression allocates gigabytes before any output). A process can be stopped: the worker caps its own address space
(RLIMIT_AS, where the platform enforces it; macOS does not, and there the time bound ends a runaway worker), streams
the template's output counting characters, and the parent kills it when a render outlasts its time. What a killed
or failed worker held goes back to the system with it; the next render starts a fresh one.

Contract:
- `TemplateSandbox(RenderLimits)`: `render(template, context) -> str` renders `template` (Jinja source) with the
  variables of `context` (JSON values) in the environment `environment()` builds, in one of at most
  `limits.workers` worker processes (started on first use, kept for the next render; a caller past that many waits
  for one). Blocking: an event loop calls it from a worker thread. Raises ChatTemplateError with `problem`:
  SYNTAX (the template does not compile), REFUSED (it raised or failed on the conversation), LIMIT (it ran past
  `timeout_s`, `memory_bytes` or `max_output_chars`, or its worker died). `close()` ends the workers.
- `default_sandbox()`: the process's sandbox with the default RenderLimits (what ChatFormat.render uses).
- `environment()`: transformers' chat-template environment (sandboxed Jinja, trim_blocks and lstrip_blocks, loop
  controls, `{% generation %}`, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`).
- The worker is `python -I -m tether.shared.template_sandbox MEMORY_BYTES MAX_OUTPUT_CHARS`: requests and replies
  are length-prefixed JSON on its stdin and stdout; it compiles and renders, nothing else, and exits at EOF.

    text = default_sandbox().render(template, {"messages": [...], "add_generation_prompt": True})
"""

from __future__ import annotations

import datetime
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_MESSAGE_CHARS = 500  # of a ChatTemplateError's message (a template's own raise_exception text is untrusted)
_HEADER = 8  # bytes of a message's length prefix (big-endian)
_START_S = 60.0  # a worker not ready this long after it was started is not going to be (a safety net)
_CACHED = 4  # compiled templates a worker keeps (one model's, usually)


class TemplateProblem(StrEnum):
    """What a ChatTemplateError is about: programs branch on it, never on the message."""

    FORMAT = "format"  # from_json: the text is not a chat format's JSON object (or a field is wrong)
    SYNTAX = "syntax"  # the template does not compile
    REFUSED = "refused"  # the template refused the conversation (raise_exception, template code that fails)
    LIMIT = "limit"  # rendering ran past its time, memory or output bound


class ChatTemplateError(ValueError):
    """A chat format or template that cannot be used, or a conversation the template refuses; `problem` says
    which (REFUSED and LIMIT answer the request, FORMAT and SYNTAX are the model's or the server's side)."""

    def __init__(self, problem: TemplateProblem, message: str):
        super().__init__(" ".join(message.split())[:MAX_MESSAGE_CHARS])  # one line: printed and sent back as is
        self.problem = problem


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float = 5.0  # wall-clock seconds one render may take (chat templates take milliseconds)
    memory_bytes: int = 1 << 30  # address space of a worker process (its interpreter and Jinja take ~100 MB)
    max_output_chars: int = 16 << 20  # characters a render may produce (4x the HTTP API's largest body)
    workers: int = 2  # worker processes at most; renders past that wait for one


class TemplateSandbox:
    """Renders chat templates in worker processes under RenderLimits (see the module docstring)."""

    def __init__(self, limits: RenderLimits | None = None):
        self.limits = limits or RenderLimits()
        self._slots = threading.BoundedSemaphore(self.limits.workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []

    def render(self, template: str, context: dict[str, Any]) -> str:
        request = json.dumps({"template": template, "context": context}).encode()
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or not worker.alive():
                worker = _Worker(self.limits)
            keep = False
            try:
                reply = worker.call(request, self.limits.timeout_s)
                keep = reply.get("problem") != TemplateProblem.LIMIT
            finally:
                if keep:
                    with self._lock:
                        self._idle.append(worker)
                else:  # timed out, died, or out of memory: nothing of it is reused
                    worker.kill()
        if "text" in reply:
            return reply["text"]
        raise ChatTemplateError(TemplateProblem(reply["problem"]), reply["message"])

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_default: TemplateSandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> TemplateSandbox:
    global _default
    with _default_lock:
        if _default is None:
            _default = TemplateSandbox()
        return _default


class _Worker:
    """One worker process and its pipes; used by one render at a time."""

    def __init__(self, limits: RenderLimits):
        self.max_reply = 6 * limits.max_output_chars + (1 << 16)  # JSON's \uXXXX: 6 bytes a character at most
        cmd = [
            sys.executable,
            "-I",
            "-m",
            "tether.shared.template_sandbox",
            str(limits.memory_bytes),
            str(limits.max_output_chars),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, request: bytes, timeout_s: float) -> dict:
        """The worker's reply to `request`; a LIMIT reply when it takes over `timeout_s` (from when it is ready)
        or ends without one."""
        try:
            if not self.ready:
                self._read(1, time.monotonic() + _START_S)  # the worker says it has loaded Jinja
                self.ready = True
            deadline = time.monotonic() + timeout_s
            self._write(len(request).to_bytes(_HEADER, "big") + request, deadline)
            size = int.from_bytes(self._read(_HEADER, deadline), "big")
            if size > self.max_reply:
                return _limit(f"the chat template's output is over {self.max_reply} bytes")
            return json.loads(self._read(size, deadline))
        except TimeoutError:
            return _limit(f"the chat template took over {timeout_s:g} s to render")
        except (OSError, EOFError, ValueError):  # the worker died: out of memory, or a crash in the interpreter
            return _limit("the chat template's renderer stopped (out of memory, or a crash)")

    def _write(self, data: bytes, deadline: float) -> None:
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            if not select.select([], [fd], [], _left(deadline))[1]:
                raise TimeoutError
            view = view[os.write(fd, view[: 1 << 16]) :]

    def _read(self, n: int, deadline: float) -> bytes:
        fd, parts, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            if not select.select([fd], [], [], _left(deadline))[0]:
                raise TimeoutError
            part = os.read(fd, min(n - got, 1 << 20))
            if not part:
                raise EOFError
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe's buffered bytes have nowhere to go
                pass


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _limit(message: str) -> dict:
    return {"problem": TemplateProblem.LIMIT.value, "message": message}


# ---- the worker's side -----------------------------------------------------------------------------------------


def environment():
    """The Jinja environment transformers renders chat templates in (sandboxed: templates are untrusted code)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def compile_template(env, template: str):
    """`template` compiled in `env`; ChatTemplateError (SYNTAX) when it does not compile."""
    import jinja2

    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(TemplateProblem.SYNTAX, f"the chat template does not compile: {e}") from None
    except (RecursionError, MemoryError, ValueError, OverflowError) as e:  # nesting past the compiler's stack
        message = f"the chat template does not compile: {type(e).__name__}"
        raise ChatTemplateError(TemplateProblem.SYNTAX, message) from None


def render_compiled(compiled, context: dict[str, Any], max_chars: int | None = None) -> str:
    """A compiled template rendered with `context`, stopping once the output is over `max_chars` (LIMIT); a
    template's refusal or failure on the conversation is a ChatTemplateError (REFUSED)."""
    import jinja2

    pieces, size = [], 0
    try:
        for piece in compiled.generate(**context):
            size += len(piece)
            if max_chars is not None and size > max_chars:
                raise ChatTemplateError(
                    TemplateProblem.LIMIT, f"the chat template's output is over {max_chars} characters"
                )
            pieces.append(piece)
    except jinja2.TemplateError as e:
        message = f"the chat template refused the conversation: {e.message or e}"
        raise ChatTemplateError(TemplateProblem.REFUSED, message) from None
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as e:
        if isinstance(e, ChatTemplateError):
            raise
        # Template code that fails on these messages (say `content | trim` on a list) refuses them just the same.
        raise ChatTemplateError(
            TemplateProblem.REFUSED, f"the chat template failed on the conversation: {type(e).__name__}: {e}"
        ) from None
    return "".join(pieces)


def _serve(memory_bytes: int, max_chars: int) -> None:
    """The worker: cap memory, load Jinja, say so (one byte), then answer requests until stdin closes."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):  # no such limit here (Windows), or not lowerable: time still bounds
        pass
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    inp = sys.stdin.buffer
    env, cache = environment(), {}
    out.write(b"\1")
    out.flush()
    while len(header := inp.read(_HEADER)) == _HEADER:
        request = json.loads(inp.read(int.from_bytes(header, "big")))
        try:
            reply = {"text": _render_request(env, cache, request, max_chars)}
        except ChatTemplateError as e:
            reply = {"problem": e.problem.value, "message": str(e)}
        except MemoryError:
            reply = _limit("the chat template ran out of memory")
        data = json.dumps(reply).encode()
        out.write(len(data).to_bytes(_HEADER, "big") + data)
        out.flush()
        if reply.get("problem") == TemplateProblem.LIMIT:
            return  # the parent replaces a worker that hit a bound


def _render_request(env, cache: dict, request: dict, max_chars: int) -> str:
    template = request["template"]
    compiled = cache.get(template)
    if compiled is None:
        compiled = compile_template(env, template)
        if len(cache) >= _CACHED:
            cache.pop(next(iter(cache)))
        cache[template] = compiled
    return render_compiled(compiled, request["context"], max_chars)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
