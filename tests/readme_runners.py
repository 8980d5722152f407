"""Running the examples of README.md and docs/USAGE.md in tests (tests/test_readme.py): their fenced blocks, and a
lab to run them in.

Contract:
- `readme_blocks(path)` -> [Block]: every fenced block of the page in order, with its language ("" for shell
  commands, else the fence's tag), the page, the section (the last heading above it) and its line. A shell block
  gives one Block per command: `\\` continuations joined, blank lines and lines starting with `#` left out; a
  trailing `# comment` stays in `text` (shlex drops it from `argv`).
- `Block.words`: the command without its `[optional flags]` groups (nested ones too); `Lab.argv(words)` reads `~`
  as the lab's HOME and `.venv/bin/X` as the X beside sys.executable. `bracket_flags(text)`: the flags inside the
  groups with their values, as the page writes them, so that a runner takes its subset from the page itself.
- `Lab(root, home)`: where the commands run. `root` stands for the clone's root (the pages' commands run there):
  its `deploy` links to the repository's (read only), runs/, data/ and models/ are written there. The environment
  has an empty HOME, no TETHER_* variable, one torch thread (the machine has two cores, shared) and the Hugging Face
  hub offline.
  `run(argv)` runs a command to its end and asserts status 0; `start(argv, prefixes)` starts one in the background
  and waits (bounded) for the lines it prints as it listens; `serve(key, argv)` keeps one such server per key, one
  at a time (starting one stops the others); `stop_all()` sends SIGTERM to whatever is left and checks its status.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WAIT_S = 180  # the longest one command may take on a busy 2-core machine before the test gives up on it
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
HEADING = re.compile(r"^#+\s+(.*)$")


@dataclass(frozen=True)
class Block:
    lang: str  # "" (shell commands), "python", "json", "text"
    text: str  # the command (continuations joined) or the whole block
    line: int  # 1-based line of the command or of the block's first line
    section: str  # the heading above it
    page: str  # the file it is in, relative to the clone's root

    @property
    def words(self) -> list[str]:
        """The command's words without its optional flags (as a shell would split it, comments left out)."""
        return shlex.split(without_brackets(self.text), comments=True)

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.section}): {self.text.splitlines()[0]}"


def readme_blocks(path: Path) -> list[Block]:
    page = path.resolve().relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    section, i = "", 0
    while i < len(lines):
        if heading := HEADING.match(lines[i]):
            section = heading.group(1)
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = len(fence.group(1)), fence.group(2), i + 1
        end = start
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        body = [line[indent:] for line in lines[start:end]]
        if lang:
            blocks.append(Block(lang, "\n".join(body), start + 1, section, page))
        else:
            blocks.extend(_commands(body, start + 1, section, page))
        i = end + 1
    return blocks


def _commands(body: list[str], first_line: int, section: str, page: str) -> list[Block]:
    commands, pending, at = [], "", 0
    for n, raw in enumerate(body, first_line):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        at = at if pending else n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        commands.append(Block("", pending + line, at, section, page))
        pending = ""
    return commands


def _split_brackets(text: str) -> tuple[str, str]:
    """(the text outside its [ ... ] groups, the text inside them): groups nest, and brackets within quotes
    (`".[client]"`, a JSON body) are text."""
    outside, inside, depth, quote = [], [], 0, ""
    for ch in text:
        if quote or ch not in "[]":
            quote = "" if ch == quote else quote or (ch if ch in "'\"" else "")
            (inside if depth else outside).append(ch)
            continue
        depth += 1 if ch == "[" else -1
        inside.append(" ")
    return "".join(outside), "".join(inside)


def without_brackets(text: str) -> str:
    """The text without its [ ... ] groups, nested ones included (a documented command's optional flags)."""
    return re.sub(r"\s+", " ", _split_brackets(text)[0]).strip()


def bracket_flags(text: str) -> dict[str, list[str]]:
    """Every flag inside the [ ... ] groups of a command, with the words that follow it up to the next flag."""
    inside = _split_brackets(text)[1]
    flags: dict[str, list[str]] = {}
    current = None
    for word in shlex.split(inside):
        if word.startswith("--"):
            current = flags.setdefault(word, [])
        elif current is not None:
            current.append(word)
    return flags


def pick(text: str, *names: str, **values: str) -> list[str]:
    """argv words for the named bracket flags of `text`, each with the page's own values (or `values[name]`, the
    flag's name without dashes, with _ for -); a name the page does not have is an error in the test's table."""
    flags = bracket_flags(text)
    argv: list[str] = []
    for name in names:
        assert name in flags, f"{name} is no longer among the optional flags of: {text}"
        key = name.lstrip("-").replace("-", "_")
        argv += [name, *([values[key]] if key in values else flags[name])]
    return argv


def expand(words: list[str], home: Path) -> list[str]:
    """`.venv/bin/X` as the X beside this interpreter, `~/` as `home`."""
    out = []
    for word in words:
        if word.startswith(".venv/bin/"):
            word = str(BIN / word.removeprefix(".venv/bin/"))
        out.append(f"{home}/{word[2:]}" if word.startswith("~/") else word)
    return out


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag`'s value set to `value` (appended when the flag is absent)."""
    if flag in argv:
        i = argv.index(flag)
        return [*argv[: i + 1], value, *argv[i + 2 :]]
    return [*argv, flag, value]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Background:
    """A command running in the background: its stdout lines as they come, its stderr in `log`."""

    argv: list[str]
    proc: subprocess.Popen
    log: Path
    lines: queue.Queue = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)
    found: dict[str, str] = field(default_factory=dict)  # prefix -> the rest of its line

    def wait_for(self, prefix: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=WAIT_S)
            except queue.Empty:
                line = None
            if line is None:  # the command ended (or said nothing for WAIT_S)
                raise AssertionError(f"{shlex.join(self.argv)} never printed {prefix!r}; stdout {self.seen}; "
                                     f"stderr:\n{self.log.read_text()[-4000:]}")  # fmt: skip
            self.seen.append(line)
            if line.startswith(prefix):
                self.found[prefix] = line.removeprefix(prefix).strip()
                return self.found[prefix]

    def stop(self) -> str:
        """SIGTERM, then its status must be 0; returns the stdout it printed after the lines already read."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=WAIT_S)
        finally:
            self.proc.kill()
        rest = []
        while (line := self.lines.get(timeout=WAIT_S)) is not None:
            rest.append(line)
        self.proc.stdout.close()
        assert self.proc.returncode == 0, (
            f"{shlex.join(self.argv)} ended with {self.proc.returncode}:\n" + (self.log.read_text()[-4000:])
        )
        return "\n".join(rest)


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


class Lab:
    def __init__(self, root: Path, home: Path):
        self.root, self.home = root, home
        root.mkdir(parents=True, exist_ok=True)
        home.mkdir(parents=True, exist_ok=True)
        (root / "deploy").symlink_to(ROOT / "deploy")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        self.env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
        self.servers: dict[str, Background] = {}
        self.background: list[Background] = []
        self.cleanup: list = []  # callables run by stop_all (listeners the runners opened)
        self.done: dict[str, BaseException | None] = {}  # block text -> how its runner ended (prerequisites run once)
        self._logs = 0

    def argv(self, words: list[str]) -> list[str]:
        return expand(words, self.home)

    def run(self, argv: list[str], stdin: str | None = None, cwd: Path | None = None,
            status: int = 0) -> subprocess.CompletedProcess:  # fmt: skip
        quiet = {} if stdin is not None else {"stdin": subprocess.DEVNULL}
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=cwd or self.root,
                              env=self.env, timeout=WAIT_S, **quiet)  # fmt: skip
        assert done.returncode == status, (
            f"{shlex.join(argv)} ended with {done.returncode}, not {status}:\n{done.stderr[-4000:]}"
        )
        return done

    def start(self, argv: list[str], *prefixes: str) -> Background:
        self._logs += 1
        log = self.root / f"background-{self._logs}.log"
        with log.open("w") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                    cwd=self.root, env=self.env)  # fmt: skip
        job = Background(argv, proc, log)
        threading.Thread(target=_pump, args=(proc.stdout, job.lines), daemon=True).start()
        self.background.append(job)
        for prefix in prefixes:
            job.wait_for(prefix)
        return job

    def stop(self, job: Background) -> str:
        self.background.remove(job)
        return job.stop()

    def serve(self, key: str, argv: list[str], *prefixes: str) -> Background:
        """The server started from `argv` under `key`, started now unless it is running; any other stops first (at
        most one server at a time: they are the heaviest processes here)."""
        for other in [k for k in self.servers if k != key]:
            self.stop(self.servers.pop(other))
        if key not in self.servers:
            self.servers[key] = self.start(argv, *prefixes)
        return self.servers[key]

    def stop_all(self) -> None:
        self.servers.clear()
        for close in self.cleanup:
            close()
        errors = []
        for job in list(self.background):
            try:
                self.stop(job)
            except AssertionError as e:
                errors.append(str(e))
        assert not errors, "\n".join(errors)
