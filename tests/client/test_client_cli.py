"""`tether-client info` describes the edge install and a model's pairing fingerprint; `generate` offers the drafter
backends and the ONNX part's precisions as choices, with their defaults in --help."""

import json

import pytest
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


def test_generate_help_lists_the_backends_and_precisions_with_their_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "--backend {onnx,torch}" in out and "(default: onnx)" in out
    assert "--precision {fp32,fp16,int8}" in out and "(default: fp32)" in out


def test_an_unknown_backend_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "x", "--backend", "tflite"])
    assert done.value.code == 2 and "invalid choice: 'tflite'" in capsys.readouterr().err
