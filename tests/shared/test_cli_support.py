"""The command lines' shared conventions (tether.shared.cli_support, tether.shared.env): every flag also from its
TETHER_* variable, parsed and checked as the flag's value, the command line winning; --help with each flag's
default, choices and variable; address types; and all three programs built on them."""

import argparse
import os
from dataclasses import dataclass

import pytest

from tether.shared import env
from tether.shared.cli_support import (
    EnvParser,
    LazyParser,
    add_dataclass_args,
    build_config,
    flag_variable,
    host,
    host_port,
)


@dataclass(frozen=True)
class Demo:
    port: int = 50051  # port to listen on
    mode: str = "keep"  # what to do
    rate: float = 0.5  # a fraction
    verbose: bool = False  # say more
    files: tuple[str, ...] = ()  # input files
    name: str = ""  # a name; empty = none


def demo_parser() -> EnvParser:
    parser = EnvParser(prog="demo")
    add_dataclass_args(parser, Demo, choices={"mode": ("keep", "rewind")})
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="override a field")
    parser.add_argument("--json", action="store_true", help="one JSON line")
    parser.add_argument("--prompt", required=True, help="the text")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", default="", help="the key")
    key.add_argument("--api-key-file", default="", help="a file holding the key")
    return parser


@pytest.fixture
def clean_env(monkeypatch):
    """No TETHER_* variable of the machine running the tests leaks into them."""
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_variable_names_values_and_switches():
    assert env.variable("--max-new-tokens") == "TETHER_MAX_NEW_TOKENS"
    with pytest.raises(ValueError):
        env.variable("-k")
    assert env.value("TETHER_X", {"TETHER_X": "1"}) == "1"
    assert env.value("TETHER_X", {"TETHER_X": ""}) is None and env.value("TETHER_X", {}) is None
    assert [env.parse_bool(t) for t in ("1", "TRUE", " yes ", "0", "False", "no")] == [True] * 3 + [False] * 3
    with pytest.raises(ValueError, match="maybe"):
        env.parse_bool("maybe")


def test_flags_come_from_their_variables_parsed_as_the_flag(clean_env):
    clean_env.setenv("TETHER_PORT", "50100")
    clean_env.setenv("TETHER_MODE", "rewind")
    clean_env.setenv("TETHER_VERBOSE", "yes")
    clean_env.setenv("TETHER_JSON", "1")
    clean_env.setenv("TETHER_FILES", "a.py 'my file.py'")
    clean_env.setenv("TETHER_SET", "moda=false n_layers=2")
    clean_env.setenv("TETHER_PROMPT", "hello")  # a required flag may come from its variable alone
    args = demo_parser().parse_args([])
    assert (args.port, args.mode, args.verbose, args.json, args.prompt) == (50100, "rewind", True, True, "hello")
    assert args.files == ["a.py", "my file.py"] and args.set == ["moda=false", "n_layers=2"]
    assert build_config(Demo, args) == Demo(port=50100, mode="rewind", verbose=True, files=("a.py", "my file.py"))


def test_the_command_line_wins(clean_env):
    for name, value in {"PORT": "50100", "VERBOSE": "1", "SET": "a=1 b=2", "FILES": "x y", "PROMPT": "env"}.items():
        clean_env.setenv("TETHER_" + name, value)
    argv = ["--port", "7", "--no-verbose", "--set", "c=3", "--files", "z", "--prompt", "argv"]
    args = demo_parser().parse_args(argv)
    assert (args.port, args.verbose, args.set, args.files, args.prompt) == (7, False, ["c=3"], ["z"], "argv")


def test_a_flag_its_exclusive_partner_gives_leaves_the_variable_unread(clean_env):
    clean_env.setenv("TETHER_API_KEY", "from-env")
    args = demo_parser().parse_args(["--prompt", "p", "--api-key-file", "k.txt"])
    assert (args.api_key, args.api_key_file) == ("", "k.txt")
    assert demo_parser().parse_args(["--prompt", "p"]).api_key == "from-env"


def test_a_variable_satisfies_a_required_group(clean_env, capsys):
    parser = EnvParser(prog="p")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text")
    source.add_argument("--prompt-file", help="a file holding it")
    clean_env.setenv("TETHER_PROMPT", "hi")
    assert parser.parse_args([]).prompt == "hi"
    args = parser.parse_args(["--prompt-file", "f.txt"])
    assert (args.prompt, args.prompt_file) == (None, "f.txt")
    clean_env.delenv("TETHER_PROMPT")
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "one of the arguments --prompt --prompt-file is required" in capsys.readouterr().err
    assert source.required and all(not a.required for a in source._group_actions)  # as they were


def test_two_exclusive_variables_are_refused(clean_env, capsys):
    clean_env.setenv("TETHER_API_KEY", "a")
    clean_env.setenv("TETHER_API_KEY_FILE", "b")
    with pytest.raises(SystemExit) as exit_:
        demo_parser().parse_args(["--prompt", "p"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "TETHER_API_KEY and TETHER_API_KEY_FILE" in err


def test_an_empty_variable_counts_as_unset(clean_env):
    clean_env.setenv("TETHER_PORT", "")
    clean_env.setenv("TETHER_MODE", "")
    args = demo_parser().parse_args(["--prompt", "p"])
    assert (args.port, args.mode) == (50051, "keep")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TETHER_PORT", "fifty", "invalid int value: 'fifty'"),
        ("TETHER_MODE", "sometimes", "invalid choice: 'sometimes'"),
        ("TETHER_VERBOSE", "maybe", "expected one of 1, true, yes, 0, false, no"),
        ("TETHER_JSON", "2", "expected one of"),
        ("TETHER_RATE", "half", "invalid float value"),
        ("TETHER_FILES", "'unclosed", "quotation"),
    ],
)
def test_an_invalid_variable_is_one_line_naming_it_and_status_2(clean_env, capsys, name, value, says):
    clean_env.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        demo_parser().parse_args(["--prompt", "p", "--port", "1"])  # checked even when the command line wins
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"demo: error: {name} (for --") and says in err, err


def test_lazy_subcommand_parsers_read_the_environment_and_show_it(clean_env, capsys):
    built = []

    def add_arguments(parser):
        built.append(parser.prog)
        add_dataclass_args(parser, Demo)

    parser = EnvParser(prog="prog")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    sub.add_parser("run", add_arguments=add_arguments)
    clean_env.setenv("TETHER_RATE", "0.25")
    assert built == []
    assert parser.parse_args(["run"]).rate == 0.25 and built == ["prog run"]
    clean_env.setenv("TETHER_RATE", "x")
    with pytest.raises(SystemExit):
        parser.parse_args(["run"])
    assert capsys.readouterr().err.startswith("prog run: error: TETHER_RATE (for --rate)")


def help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help entry of one flag, on one line."""
    return " ".join(parser._get_formatter()._format_action(action).split())


def test_help_shows_every_flags_default_choices_and_variable():
    parser = demo_parser()
    entries = {a.option_strings[0]: help_of(parser, a) for a in parser._actions if a.option_strings}
    assert entries["--port"].endswith("port to listen on (default: 50051) (env: TETHER_PORT)")
    assert entries["--mode"].startswith("--mode {keep,rewind}")
    assert "(default: keep) (env: TETHER_MODE)" in entries["--mode"]
    assert "(default: false) (env: TETHER_VERBOSE)" in entries["--verbose"]
    assert '(default: "") (env: TETHER_NAME)' in entries["--name"]
    assert "(default: none) (env: TETHER_FILES)" in entries["--files"]
    assert "(required) (env: TETHER_PROMPT)" in entries["--prompt"]
    assert "env:" not in entries["-h"]
    hidden = EnvParser(prog="p")
    action = hidden.add_argument("--level", choices=("a", ""), default="", metavar="LEVEL", help="how much")
    assert help_of(hidden, action) == '--level LEVEL how much (choices: a, "") (default: "") (env: TETHER_LEVEL)'
    said = hidden.add_argument("--bar", action=argparse.BooleanOptionalAction, help="a bar (default: on a terminal)")
    assert help_of(hidden, said) == "--bar, --no-bar a bar (default: on a terminal) (env: TETHER_BAR)"


def test_variables_belong_to_flags_that_take_values_or_switch():
    parser = EnvParser(prog="p", add_help=True)
    count = parser.add_argument("--verbose", "-v", action="count", default=0)
    positional = parser.add_argument("path")
    assert flag_variable(count) is None and flag_variable(positional) is None
    assert flag_variable(parser._actions[0]) is None  # --help


def test_address_types():
    for good in ("127.0.0.1:50051", "localhost:0", "[::1]:443", "example.com:65535"):
        assert host_port(good) == good
    for bad in ("localhost", "127.0.0.1", ":50051", "host:", "host:70000", "::1:50051", "a b:1", "http://h:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected HOST:PORT"):
            host_port(bad)
    assert host("--port")("0.0.0.0") == "0.0.0.0" and host("--port")("::") == "::"
    with pytest.raises(argparse.ArgumentTypeError, match="give the host alone, and the port with --port"):
        host("--port")("0.0.0.0:50051")


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for a in subs for name, p in a.choices.items()} or {parser.prog: parser}


def all_parsers():
    from tether.client.cli import build_parser as client
    from tether.netsim.cli import build_parser as netsim
    from tether.server.cli import build_parser as server

    for build in (server, client, netsim):
        top = build()
        for name, parser in subcommand_parsers(top).items():
            parser.format_help()  # builds a lazy parser's flags
            yield top, name, parser


def test_every_flag_of_every_program_shows_its_default_and_variable_and_has_a_valid_default():
    seen = set()
    for top, name, parser in all_parsers():
        seen.add(top.prog)
        assert any("--version" in a.option_strings for a in top._actions), f"{top.prog} has no --version"
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue
            entry = help_of(parser, action)
            assert "(required)" in entry or "(default: " in entry, f"{top.prog} {name}: {entry}"
            if flag_variable(action) is not None:
                assert f"(env: {flag_variable(action)})" in entry, f"{top.prog} {name}: {entry}"
            if action.choices is not None and not action.required and not isinstance(action.default, list):
                assert action.default in action.choices, f"{top.prog} {name} {action.option_strings[0]}"
    assert seen == {"tether-server", "tether-client", "tether-netsim"}


def test_log_handlers_write_to_the_stderr_of_the_moment(monkeypatch):
    """A command run inside a test configures logging while stderr is captured; once that capture is closed, later
    records must reach the new stderr, not raise "--- Logging error ---" on a closed stream."""
    import io
    import logging
    import sys

    from tether.client.logs import LogConfig, configure
    from tether.server.logs import configure_logging

    for setup, name in [(lambda: configure_logging("text", "info"), "tether.server"),
                        (lambda: configure(LogConfig(log_level="info")), "tether.edge")]:  # fmt: skip
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        setup()
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger(name).warning("after the capture closed")
        assert "after the capture closed" in second.getvalue() and "Logging error" not in second.getvalue()
    logging.getLogger("tether").handlers.clear()
