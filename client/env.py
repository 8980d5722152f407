"""The client's TETHER_* variables beyond its flags' own (each flag reads TETHER_<FLAG> through
tether.shared.cli_support): the bearer key's lookup as the key-file logic needs it. tether.shared.env is the one
module that reads the environment; this one only names what the client takes from it.

- TETHER_API_KEY: the bearer key, when neither --api-key nor --api-key-file gives one. A key on the command line
  can be read by every user of the machine (ps, /proc/PID/cmdline); the environment and a file cannot.

    key = api_key()  # "" when unset
"""

from __future__ import annotations

from collections.abc import Mapping

from tether.shared import env

API_KEY = "TETHER_API_KEY"


def api_key(environ: Mapping[str, str] | None = None) -> str:
    """TETHER_API_KEY, surrounding whitespace removed; "" when unset."""
    return (env.value(API_KEY, environ) or "").strip()
