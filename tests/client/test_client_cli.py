"""`tether-client info` describes the edge install and a model's pairing fingerprint; `generate` offers the drafter
backends and the ONNX part's precisions as choices, with their defaults in --help."""

import dataclasses
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


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_every_session_flag_shows_its_default_and_every_enumeration_its_choices(command, capsys):
    from tether.client.session_types import CHOICES, ClientConfig

    out = help_text(capsys, command)
    for name, choices in CHOICES.items():
        assert f"--{name} {{{','.join(choices)}}}" in out
    for flag, default in (("--max-new-tokens", 128), ("--connect-timeout-s", 10.0), ("--policy", "keep")):
        assert f"{flag}" in out and f"(default: {default})" in out
    assert out.count("(default:") >= len(dataclasses.fields(ClientConfig))
    assert ("--session-file" in out) == (command == "generate")  # a chat is not one generation to resume


def test_chat_help_names_the_system_message_and_the_history_file(capsys):
    out = help_text(capsys, "chat")
    assert "--system" in out and "--history-file" in out and "chat_history" in out


def test_the_prompt_comes_from_exactly_one_of_its_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "x", "--prompt-file", str(tmp_path / "p.txt")])
    assert done.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["generate"])
    assert done.value.code == 2 and "one of the arguments --prompt --prompt-file is required" in capsys.readouterr().err


def test_a_missing_prompt_file_is_one_line_before_anything_is_dialled(tmp_path, capsys):
    # No server listens at this address: the file is read first, so the error is the file's.
    assert main(["generate", "--prompt-file", str(tmp_path / "nope.txt"), "--server", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.txt" in err and "connecting" not in err
