"""The client reads its environment in one module, tether.client.env, which lists every TETHER_* variable."""

import re
from pathlib import Path

import tether.client
from tether.client import env


def test_api_key_comes_from_tether_api_key():
    assert env.api_key({"TETHER_API_KEY": " k1 \n"}) == "k1"
    assert env.api_key({}) == ""


def test_no_other_client_module_reads_the_environment():
    (folder,) = tether.client.__path__
    reads = re.compile(r"\bos\.environ\b|\bgetenv\b|\bimport environ\b")
    assert [f.name for f in Path(folder).glob("*.py") if reads.search(f.read_text())] == ["env.py"]
