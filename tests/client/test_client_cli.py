"""`tether-client info` describes the edge install and a model's pairing fingerprint."""

import json

import torch

from tether.client.cli import main
from tether.shared.checkpoint import fingerprint
from tether.shared.config import PRESETS
from tether.shared.model import Transformer


def test_info_reports_backends_and_model_fingerprint(tmp_path, capsys):
    Transformer(PRESETS["tiny"]).save_pretrained(tmp_path, dtype=torch.bfloat16)
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] and report["tokenizers"]
    assert report["model"]["fingerprint"] == fingerprint(tmp_path)
    assert report["model"]["config"]["moda"] is True


def test_info_on_a_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["info", "--model", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err
