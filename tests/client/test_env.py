"""The environment is read in one module, tether.shared.env; tether.client.env names the client's key variable."""

import re
from pathlib import Path

import tether.client
import tether.shared
from tether.client import env


def test_api_key_comes_from_tether_api_key():
    assert env.api_key({"TETHER_API_KEY": " k1 \n"}) == "k1"
    assert env.api_key({}) == ""


def test_only_tether_shared_env_reads_the_environment():
    reads = re.compile(r"\bos\.environ\b|\bgetenv\b|\bimport environ\b")
    (client,) = tether.client.__path__
    (shared,) = tether.shared.__path__
    assert [f.name for f in Path(client).glob("*.py") if reads.search(f.read_text())] == []
    assert [f.name for f in Path(shared).glob("*.py") if reads.search(f.read_text())] == ["env.py"]
