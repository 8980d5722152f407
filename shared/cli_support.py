"""What both command lines share: frozen config dataclasses as argparse flags, and one way to report errors.

Contract:
- `add_dataclass_args(parser, Cls)` adds one --flag per field (defaults from the dataclass, help from the
  field's trailing comment); `build_config(Cls, args)` turns the parsed flags back into a frozen instance.
- `parse_overrides(["field=JSON", ...])` reads `--set` overrides into (field, value) pairs.
- `run_cli(parser, argv)` parses, runs the chosen subcommand and turns the errors a user can act on (a missing
  file, a bad value) into one line on stderr and exit status 2, without a traceback.
- `LazyParser`: a subcommand parser (`add_subparsers(parser_class=LazyParser)`) whose `add_arguments(parser)`
  runs the first time it parses or prints help, so a top-level `--help` never imports what the flags are built from
  (the edge client's come from its session module, and everything that imports).
- `add_version_flag(parser, distribution)`: `--version` that reads the installed version only when it is asked.

    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    sub.add_parser("generate", add_arguments=lambda p: add_dataclass_args(p, Config)).set_defaults(func=generate)
    run_cli(parser, argv)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
from collections.abc import Callable, Sequence


def field_comments(cls) -> dict[str, str]:
    """The trailing comment of each dataclass field, which is its documentation."""
    pattern = re.compile(r"^\s+(\w+): [^#]*#\s*(.+)$")
    return {m.group(1): m.group(2) for line in inspect.getsource(cls).splitlines() if (m := pattern.match(line))}


def add_dataclass_args(parser: argparse.ArgumentParser, cls, skip: Sequence[str] = (), helps: dict | None = None):
    """One --flag per field; defaults from the dataclass; help from `helps`, else the field's comment."""
    helps = field_comments(cls) | (helps or {})
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps.get(f.name))
        elif isinstance(default, tuple):
            parser.add_argument(flag, nargs="*", default=list(default), help=helps.get(f.name))
        else:
            parser.add_argument(flag, type=type(default), default=default, help=helps.get(f.name))


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


def run_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2


class LazyParser(argparse.ArgumentParser):
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
