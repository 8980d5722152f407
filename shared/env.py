"""The TETHER_* environment: the one module of tether that reads it, so what it may hold is stated here.

Contract:
- Every flag of tether-server and tether-client can also come from a variable (tether-netsim reads its own the
  same way, in netsim/cli.py, to stay standalone): `--foo-bar` from
  TETHER_FOO_BAR (`variable("--foo-bar")`). tether.shared.cli_support.EnvParser applies them to every parser and
  subcommand parser it builds; a value on the command line wins over the variable, the variable over the default.
- One variable per flag name: subcommands that share a flag name share its variable (TETHER_DEVICE is the --device
  of serve, generate, train-target and train-drafter alike; TETHER_JSON the --json of every command that has one).
  A variable that no flag of the command being run reads is ignored, so one environment can serve every command.
- `value(name)`: the variable's text, or None when it is unset or empty. Empty counts as unset because service
  managers define variables empty to mean "no value" (deploy/systemd's units do); such a flag keeps its default.
- The text is parsed as the flag's value would be (type, choices); a switch takes 1/0, true/false, yes/no
  (`parse_bool`, any case); a flag that takes several values, or may be repeated, takes them separated by spaces
  (shell quoting for one with a space in it: `shlex.split`).
- There are no other TETHER_* variables: a secret such as the client's API key is its flag's variable
  (TETHER_API_KEY is --api-key), which keeps it out of the process list.

    export TETHER_PORT=50052 TETHER_LOG_FORMAT=json
    tether-server serve                 # the same as tether-server serve --port 50052 --log-format json
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "TETHER_"
TRUE = ("1", "true", "yes")
FALSE = ("0", "false", "no")


def variable(flag: str) -> str:
    """The variable of a long flag: "--foo-bar" -> "TETHER_FOO_BAR"."""
    if not flag.startswith("--") or len(flag) < 3:
        raise ValueError(f"not a long flag: {flag!r}")
    return PREFIX + flag[2:].upper().replace("-", "_")


def value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of variable `name`; None when it is unset or empty."""
    text = (os.environ if environ is None else environ).get(name, "")
    return text or None


def parse_bool(text: str) -> bool:
    """A switch's value: 1/true/yes or 0/false/no, in any case and surrounding spaces ignored."""
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(TRUE + FALSE)}, got {text!r}")
