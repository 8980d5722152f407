"""What the command lines share: config dataclasses as flags, TETHER_* variables, help, errors, --version.

Contract:
- `EnvParser`: an ArgumentParser (the class of every parser and subcommand parser of tether-server and
  tether-client; tether-netsim follows the same conventions with code of its own, to stay standalone) whose
  every flag can also come from its TETHER_* variable (tether.shared.env: `--foo-bar` from TETHER_FOO_BAR, one
  variable per flag name). A variable is parsed as the flag's value would be: its type and choices, a switch as
  1/0/true/false/yes/no, a flag of several values (or one that may be repeated) as values separated by spaces.
  An invalid one ends the command in one line naming the variable, with exit status 2. The command line wins: a
  flag given there, or another flag of its mutually exclusive group, leaves the variable unread; a required flag
  may come from its variable alone. --help shows every flag's default, its choices and its variable
  (`HelpFormatter`).
- `LazyParser`: an EnvParser for a subcommand (`add_subparsers(parser_class=LazyParser)`) whose
  `add_arguments(parser)` runs the first time it parses or prints help, so a top-level `--help` never imports what
  the flags are built from (the edge client's come from its session module, and everything that imports).
- `add_dataclass_args(parser, Cls, choices=..., types=...)` adds one --flag per field (defaults from the dataclass,
  help from the field's trailing comment; `choices` for the fields that take one of a fixed set of values, `types`
  for those checked by a function such as `host_port`); `build_config(Cls, args)` turns the parsed flags back into a
  frozen instance. `parse_overrides(["field=JSON", ...])` reads `--set` overrides into (field, value) pairs.
- `host_port` / `host(port_flag)`: argparse types of a flag that takes HOST:PORT, or a host whose port is another
  flag; each refuses the other form when parsing, before anything dials or binds.
- `port` / `port_or_off`: argparse types of a port flag, 0 to 65535 (0: any free port; `port_or_off` also takes -1,
  off), refused when parsing: the kernel would take 99999 modulo 65536.
- `address_in_use(host, port)`: whether something listens on that port already (even a process that shares its
  port with SO_REUSEPORT, which a server's own bind with that option would join without a word).
- `check_model_dir(flag, path, needs)`: a model directory named on the command line, checked without torch: missing,
  a Hugging Face hub id rather than a directory, empty, or lacking `needs` (TARGET_FILES, DRAFTER_FILES) is one
  `CommandError` saying which and what to do. `require_device(device, flag)`: a CUDA device that this machine has
  (torch imported only for a cuda one), else a CommandError that says to use cpu.
- `run_cli(parser, argv)` parses, runs the chosen subcommand and turns the errors a user can act on (a missing
  file, a bad value, a `CommandError` with its typed `Refusal`) into one line on stderr and exit status 2, without
  a traceback. A flag that does not parse is one line too: `EnvParser.error` leaves argparse's usage out.
- `add_version_flag(parser, distribution)`: `--version` that reads the installed version only when it is asked.

    parser = EnvParser(prog="tether-thing")
    add_version_flag(parser, "tether")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    sub.add_parser("generate", add_arguments=lambda p: add_dataclass_args(p, Config)).set_defaults(func=generate)
    run_cli(parser, argv)        # TETHER_PROMPT=hi tether-thing generate  ==  tether-thing generate --prompt hi
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import inspect
import itertools
import json
import logging
import re
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import NoReturn

from tether.shared import env


class StderrHandler(logging.StreamHandler):
    """A handler writing to whatever sys.stderr is when a record comes: a command run inside a test (or anything that
    swaps stderr) must not leave a handler bound to a stream that has since been closed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def field_comments(cls) -> dict[str, str]:
    """The trailing comment of each dataclass field, which is its documentation."""
    pattern = re.compile(r"^\s+(\w+): [^#]*#\s*(.+)$")
    return {m.group(1): m.group(2) for line in inspect.getsource(cls).splitlines() if (m := pattern.match(line))}


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls,
    skip: Sequence[str] = (),
    helps: Mapping[str, str] | None = None,
    choices: Mapping[str, Sequence[str]] | None = None,
    types: Mapping[str, Callable[[str], object]] | None = None,
) -> None:
    """One --flag per field; defaults from the dataclass; help from `helps`, else the field's comment; `choices`
    and `types` (a function of the text, for a list flag of each item) by field name."""
    helps = field_comments(cls) | dict(helps or {})
    choices, types = choices or {}, types or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        extra = {"choices": tuple(choices[f.name])} if f.name in choices else {}
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps.get(f.name))
        elif isinstance(default, tuple):
            parser.add_argument(
                flag, nargs="*", default=list(default), type=types.get(f.name), help=helps.get(f.name), **extra
            )
        else:
            parser.add_argument(
                flag, type=types.get(f.name, type(default)), default=default, help=helps.get(f.name), **extra
            )


def build_config(cls, args: argparse.Namespace, **extra):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values, **extra)


def parse_overrides(items: Sequence[str]) -> tuple[tuple[str, object], ...]:
    """`--set field=JSON` items -> ((field, value), ...); a bare word that is not JSON is taken as a string."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes FIELD=VALUE, got {item!r}")
        try:
            out.append((key, json.loads(raw)))
        except json.JSONDecodeError:
            out.append((key, raw))
    return tuple(out)


class Refusal(StrEnum):
    """Why a command stopped before its work: what code and tests branch on (the message is for people)."""

    ADDRESS_IN_USE = "address in use"  # another process listens on the port
    CANNOT_LISTEN = "cannot listen"  # the bind failed otherwise (a privileged port, an address not of this host)
    NO_CUDA = "no CUDA device"  # a cuda device asked of a machine (or a PyTorch build) without one
    NO_SUCH_DIR = "no such directory"
    HUB_ID = "a hub id, not a directory"  # a missing path shaped like owner/name, where hub ids are not read
    NOT_CACHED = (
        "hub id not cached"  # a hub id that is not in the local Hugging Face cache (tether.shared.model_source)
    )
    NOT_A_DIR = "not a directory"
    EMPTY_DIR = "empty directory"
    INCOMPLETE_DIR = "files missing"


class CommandError(Exception):
    """An error a user can act on: `run_cli` prints its message as one line, with exit status 2."""

    def __init__(self, reason: Refusal, message: str):
        super().__init__(message)
        self.reason = reason


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, CommandError) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2


# ---- model directories and devices -----------------------------------------------------------------------------

# The files a directory must hold, each entry one of its names: a target (ours or a Hugging Face Llama / Qwen2
# one; sharded weights come with their index) and a drafter (tether-server train-drafter's --out).
TARGET_FILES = (("tokenizer.json",), ("config.json",), ("model.safetensors", "model.safetensors.index.json"))
DRAFTER_FILES = (("drafter_config.json",), ("drafter.safetensors",))
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+", re.ASCII)


def _files(needs: Sequence[Sequence[str]]) -> str:
    return ", ".join(names[0] + "".join(f" (or {name})" for name in names[1:]) for names in needs)


def check_model_dir(flag: str, path: str, needs: Sequence[Sequence[str]] = ()) -> None:
    """`path` (given as `flag`) is a directory holding one of each entry of `needs`, or a CommandError that says
    what it is instead and what to do. Reads the directory only: no torch, no weights."""
    where = Path(path).expanduser()
    if not where.exists():
        if HUB_ID.fullmatch(path):
            raise CommandError(
                Refusal.HUB_ID,
                f"{flag} {path}: no such directory; tether loads local directories "
                f"only: if it is a Hugging Face hub id, download it with `hf download {path} "
                f"--local-dir DIR` and pass {flag} DIR",
            )
        raise CommandError(Refusal.NO_SUCH_DIR, f"{flag} {path}: no such directory")
    if not where.is_dir():
        raise CommandError(Refusal.NOT_A_DIR, f"{flag} {path}: a file, not a directory")
    if next(where.iterdir(), None) is None:
        wanted = f": no {_files(needs)}" if needs else ""
        raise CommandError(Refusal.EMPTY_DIR, f"{flag} {path}: the directory is empty{wanted}")
    missing = [names for names in needs if not any((where / name).is_file() for name in names)]
    if missing:
        raise CommandError(
            Refusal.INCOMPLETE_DIR, f"{flag} {path}: no {_files(missing)} in it (it needs {_files(needs)})"
        )


def require_device(device: str, flag: str = "--device") -> None:
    """A CommandError unless `device` is one this machine has; torch is imported for a cuda device only."""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.partition(":")[2]
    if count and (not index.isdigit() or int(index) < count):
        return  # a malformed index is torch's to refuse
    if torch.version.cuda is None:
        why = f"this PyTorch ({torch.__version__}) was built without CUDA"
    else:
        why = "no CUDA device is visible" if not count else f"this machine has {count} (cuda:0 to cuda:{count - 1})"
    raise CommandError(Refusal.NO_CUDA, f"{flag} {device}: {why}; use {flag} cpu")


# ---- addresses -------------------------------------------------------------------------------------------------

_PORT = r"\d{1,5}"
_HOST_PORT = re.compile(rf"(?:\[[0-9A-Fa-f:.%\w]+\]|[^\s:\[\]/]+):({_PORT})", re.ASCII)


def host_port(text: str) -> str:
    """The argparse type of a flag that takes HOST:PORT ([v6]:PORT for IPv6): the text as given, or an error. A
    bare host is refused: gRPC would dial it on port 443 and the user would wait for a timeout to learn why."""
    m = _HOST_PORT.fullmatch(text)
    if m is None or int(m.group(1)) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r} (such as 127.0.0.1:50051 or [::1]:50051)")
    return text


def port(text: str) -> int:
    """The argparse type of a port flag: 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535 (0: any free port), got {text!r}")
    return value


def port_or_off(text: str) -> int:
    """The argparse type of a port flag that -1 turns off."""
    if text.strip() == "-1":
        return -1
    try:
        return port(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected -1 (off) or a port from 0 to 65535 (0: any free port), got {text!r}"
        ) from None


def address_in_use(host: str, port: int) -> bool:
    """Whether something listens on `port` at any address `host` resolves to ("" or "::": all of them). The probe
    binds without SO_REUSEPORT, so a listener that shares its port with that option counts too; port 0 never
    does. A host that does not resolve is the bind's own error to report, not this one's."""
    if port == 0:
        return False
    try:
        found = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is not in use
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def host(port_flag: str) -> Callable[[str], str]:
    """The argparse type of a flag that takes a host alone, its port being `port_flag` (--host and --port)."""

    def parse(text: str) -> str:
        if _HOST_PORT.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{text!r} has a port: give the host alone, and the port with {port_flag}")
        if any(c.isspace() or c == "/" for c in text):  # "" passes, as it always has
            raise argparse.ArgumentTypeError(f"expected a host name or IP address, got {text!r}")
        return text

    parse.__name__ = "host"
    return parse


# ---- the environment and help ----------------------------------------------------------------------------------


def flag_variable(action: argparse.Action) -> str | None:
    """The TETHER_* variable of a flag; None for what reads none: positionals, --help, --version, counters."""
    flag = next((s for s in action.option_strings if s.startswith("--")), None)
    if flag is None or action.nargs in (argparse.PARSER, argparse.REMAINDER, argparse.SUPPRESS):
        return None
    if action.nargs == 0 and not isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreConstAction)):
        return None
    return env.variable(flag)


def _shown(value: object) -> str:
    """A default or choice as a user would type it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return " ".join(_shown(v) for v in value) if value else "none"
    return str(value) if value != "" else '""'


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its choices (when its metavar hides them), its default (unless the help says it
    in its own words, "(default: ...)") and its variable: `port to listen on (default: 50051) (env: TETHER_PORT)`.
    An empty string shows as "". Descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings:
            return text
        notes = []
        if action.choices is not None and action.metavar is not None and "%(choices)" not in text:
            notes.append("choices: " + ", ".join(_shown(c) for c in action.choices))
        if action.required:
            notes.append("required")
        elif action.default is not argparse.SUPPRESS and "%(default)" not in text and "(default: " not in text:
            notes.append("default: %(default)s")
        name = flag_variable(action)
        if name is not None:
            notes.append(f"env: {name}")
        text += "".join(f" ({note})" for note in notes)
        if action.default is not argparse.SUPPRESS:
            text = text.replace("%(default)s", _shown(action.default).replace("%", "%%"))
        return text

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str):
        if action.metavar is None and action.choices is not None and action.option_strings:
            shown = "{" + ",".join(_shown(c) for c in action.choices) + "}"
            return lambda size: (shown,) * size
        return super()._metavar_formatter(action, default_metavar)


class _Unset:
    """Stands in a parse's namespace for a flag whose variable is set, until the command line does or does not."""

    def __repr__(self) -> str:
        return "<unset>"


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags also come from TETHER_* variables (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """One line, like every other error a user can act on (argparse's own prints the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        found = self._environment()
        if not found:
            return super().parse_known_args(args, namespace)
        namespace = argparse.Namespace() if namespace is None else namespace
        # Each flag that has a variable, and the flags it excludes, start as a marker no command line can produce:
        # after the parse, a marker still there means the command line left that flag out. Flags that may repeat
        # start as None, which argparse's append turns into a fresh list rather than adding to the variable's.
        markers: dict[argparse.Action, object] = {}
        for action in found:
            for a in self._excluding(action):
                if a not in markers and not hasattr(namespace, a.dest):
                    markers[a] = None if isinstance(a, argparse._AppendAction) else _Unset()
                    setattr(namespace, a.dest, markers[a])
        # A variable satisfies a required flag, or a required group (--prompt or --prompt-file), like the flag.
        supplied = {a for a in found if a in markers}
        required: list = [a for a in supplied if a.required]
        required += [g for g in self._mutually_exclusive_groups if g.required and supplied & set(g._group_actions)]
        for a in required:
            a.required = False
        try:
            namespace, extras = super().parse_known_args(args, namespace)
        finally:
            for a in required:
                a.required = True
        given = {a for a, marker in markers.items() if getattr(namespace, a.dest, marker) is not marker}
        applied = [a for a in found if a in supplied and not given & self._excluding(a)]
        for a, b in itertools.combinations(applied, 2):
            if b in self._excluding(a):
                self.exit(
                    2,
                    f"{self.prog}: error: {flag_variable(a)} and {flag_variable(b)} are both set, but "
                    f"{a.option_strings[0]} and {b.option_strings[0]} exclude each other\n",
                )
        for a, marker in markers.items():
            if getattr(namespace, a.dest, marker) is marker:
                self._restore_default(namespace, a)
        for a in applied:
            setattr(namespace, a.dest, found[a])
        return namespace, extras

    def _environment(self) -> dict[argparse.Action, object]:
        """The value of every flag whose variable is set, parsed as the flag's; exit 2 on an invalid one."""
        found = {}
        for action in self._actions:
            name = flag_variable(action)
            text = None if name is None else env.value(name)
            if text is None:
                continue
            try:
                found[action] = self._parse_variable(action, text)
            except (argparse.ArgumentError, ValueError) as e:
                message = e.message if isinstance(e, argparse.ArgumentError) else str(e)
                flags = "/".join(action.option_strings)
                self.exit(2, f"{self.prog}: error: {name} (for {flags}): {message}\n")
        return found

    def _parse_variable(self, action: argparse.Action, text: str) -> object:
        """What the flag would leave in the namespace had the command line given it the variable's text."""
        flag = action.option_strings[0]
        if action.nargs == 0:
            on = env.parse_bool(text)
            if isinstance(action, argparse.BooleanOptionalAction):
                return on
            return action.const if on else action.default  # store_true, store_false, store_const
        repeated = isinstance(action, argparse._AppendAction)
        several = (
            repeated or action.nargs in (argparse.ZERO_OR_MORE, argparse.ONE_OR_MORE) or isinstance(action.nargs, int)
        )
        words = shlex.split(text) if several else [text]
        single = action.nargs in (None, argparse.OPTIONAL)
        scratch = argparse.Namespace()
        if action.default is not argparse.SUPPRESS:
            setattr(scratch, action.dest, action.default)
        for strings in [[w] for w in words] if repeated and single else [words]:
            action(self, scratch, self._convert(action, strings, single), flag)
        return getattr(scratch, action.dest)

    def _convert(self, action: argparse.Action, strings: list[str], single: bool) -> object:
        if single:
            value = self._get_value(action, strings[0])
            self._check_value(action, value)
            return value
        if action.nargs == argparse.ONE_OR_MORE and not strings:
            raise ValueError("expected at least one value")
        if isinstance(action.nargs, int) and len(strings) != action.nargs:
            raise ValueError(f"expected {action.nargs} values separated by spaces, got {len(strings)}")
        values = [self._get_value(action, s) for s in strings]
        for v in values:
            self._check_value(action, v)
        return values

    def _excluding(self, action: argparse.Action) -> set[argparse.Action]:
        """The flag and those of its mutually exclusive groups."""
        out = {action}
        for group in self._mutually_exclusive_groups:
            if action in group._group_actions:
                out.update(group._group_actions)
        return out

    def _restore_default(self, namespace: argparse.Namespace, action: argparse.Action) -> None:
        """What argparse leaves for a flag the command line left out: its default (a string one converted)."""
        if action.default is argparse.SUPPRESS:
            delattr(namespace, action.dest)
        elif isinstance(action.default, str):
            setattr(namespace, action.dest, self._get_value(action, action.default))
        else:
            setattr(namespace, action.dest, action.default)


class LazyParser(EnvParser):
    """A subcommand's parser whose arguments are added by `add_arguments(self)` on first use: parsing, help, usage."""

    def __init__(self, *args, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def _complete(self) -> None:
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()


# ---- --version -------------------------------------------------------------------------------------------------


def installed_version(distribution: str) -> str | None:
    """An installed distribution's version; None when it is absent (or, for tether, run from a source tree)."""
    import importlib.metadata  # its import costs more than the rest of a bare --help

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, distribution: str = "", help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.distribution = distribution

    def __call__(self, parser, namespace, values, option_string=None):
        version = installed_version(self.distribution) or "(not installed: run from a source tree)"
        print(f"{parser.prog} {version}")
        parser.exit()


def add_version_flag(parser: argparse.ArgumentParser, distribution: str) -> None:
    """`--version`: print PROG VERSION (the installed distribution's) and exit 0."""
    parser.add_argument(
        "--version", action=_VersionAction, distribution=distribution, help="print the version and exit"
    )
