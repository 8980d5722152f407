"""The client's environment: the one module that reads TETHER_* variables, so every one of them is listed here.

- TETHER_API_KEY: the bearer key, when neither --api-key nor --api-key-file gives one. A key on the command line
  can be read by every user of the machine (ps, /proc/PID/cmdline); the environment and a file cannot.

    key = api_key()  # "" when unset
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY = "TETHER_API_KEY"


def api_key(environ: Mapping[str, str] | None = None) -> str:
    """TETHER_API_KEY, surrounding whitespace removed; "" when unset."""
    return (os.environ if environ is None else environ).get(API_KEY, "").strip()
