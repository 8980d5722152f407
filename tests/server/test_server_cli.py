"""`tether-server`'s command line: --version, choices for every enumeration, TETHER_* variables reaching the
config (the command line winning, an invalid one refused in one line), hosts without ports, `build-corpus
--tokenizer` and train-drafter's refusal of a corpus in other token ids. Nothing here loads a model."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from tether.server.cli import build_parser, main
from tether.server.serve_config import ServeConfig
from tether.shared import env
from tether.shared.cli_support import build_config
from tether.shared.tokenizer import Tokenizer


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


def subparser(name: str) -> argparse.ArgumentParser:
    (subs,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subs.choices[name]


def flags(name: str) -> dict[str, argparse.Action]:
    parser = subparser(name)
    parser.format_help()  # builds its flags
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("tether-server ")


def test_the_top_level_help_imports_no_torch():
    """Subcommands' flags are built when they are parsed: `tether-server --help` and `--version` stay fast."""
    code = "import sys\nfrom tether.server.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    run = subprocess.run([sys.executable, "-c", code + "print('torch' in sys.modules)"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0 and "--version" in run.stdout and run.stdout.splitlines()[-1] == "False", run.stderr


@pytest.mark.parametrize(
    ("command", "flag", "choices"),
    [
        ("serve", "--dtype", ("", "float32", "bfloat16", "float16")),
        ("serve", "--attention", ("auto", "triton", "reference", "sdpa")),
        ("serve", "--log-format", ("text", "json")),
        ("serve", "--log-level", ("debug", "info", "warning", "error")),
        ("warm", "--attention", ("auto", "triton", "reference", "sdpa")),
        ("train-target", "--preset", None),
        ("train-target", "--save-dtype", ("float32", "bfloat16", "float16")),
        ("train-drafter", "--kind", ("moa", "eagle")),
        ("train-drafter", "--save-dtype", ("float32", "bfloat16", "float16")),
    ],
)
def test_enumerations_are_choices(clean_env, capsys, command, flag, choices):
    from tether.shared.config import PRESETS

    action = flags(command)[flag]
    assert tuple(action.choices) == (choices or tuple(PRESETS))
    with pytest.raises(SystemExit) as exit_:
        main([command, flag, "nonsense"])
    assert exit_.value.code == 2 and "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_every_subcommand_help_shows_defaults_choices_and_variables(clean_env):
    for command in ("build-corpus", "train-target", "train-drafter", "serve", "warm", "generate"):
        text = " ".join(subparser(command).format_help().split())
        assert "(default: " in text and "(env: TETHER_" in text, command
    serve = " ".join(subparser("serve").format_help().split())
    assert '--dtype {"",float32,bfloat16,float16}' in serve and "(default: 50051) (env: TETHER_PORT)" in serve


def test_variables_reach_the_config_and_the_command_line_wins(clean_env):
    clean_env.setenv("TETHER_PORT", "50100")
    clean_env.setenv("TETHER_LOG_FORMAT", "json")
    clean_env.setenv("TETHER_KV_POOL_MB", "64")
    clean_env.setenv("TETHER_DRAFTER", "none")
    clean_env.setenv("TETHER_PROMPT", "def f():")  # generate's flag: serve has none and ignores it
    cfg = build_config(ServeConfig, build_parser().parse_args(["serve", "--kv-pool-mb", "32"]))
    assert (cfg.port, cfg.log_format, cfg.kv_pool_mb, cfg.drafter) == (50100, "json", 32, "none")
    warm = build_parser().parse_args(["warm"])  # warm has no --port: TETHER_PORT is not its business
    assert (warm.log_format, warm.kv_pool_mb, warm.drafter) == ("json", 64, "none") and not hasattr(warm, "port")
    generate = build_parser().parse_args(["generate"])
    assert (generate.prompt, generate.drafter) == ("def f():", "none")


def test_the_bound_on_a_callers_queued_model_calls_reaches_the_service(clean_env):
    from tether.server.serve_config import service_config

    cfg = build_config(ServeConfig, build_parser().parse_args(["serve", "--max-model-calls-per-caller", "3"]))
    assert service_config(cfg).max_model_calls_per_caller == 3
    cfg = build_config(ServeConfig, build_parser().parse_args(["serve", "--max-model-calls-per-caller", "0"]))
    with pytest.raises(ValueError, match="--max-model-calls-per-caller must be positive"):
        service_config(cfg)


def test_an_invalid_variable_is_one_line_and_status_2(clean_env, capsys):
    clean_env.setenv("TETHER_MAX_SESSIONS", "many")
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err == "tether-server serve: error: TETHER_MAX_SESSIONS (for --max-sessions): invalid int value: 'many'\n"


@pytest.mark.parametrize("argv", [["serve", "--host", "0.0.0.0:50051"], ["serve", "--http-host", "localhost:8000"]])
def test_a_host_with_a_port_is_refused(clean_env, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "has a port: give the host alone" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--host", "::"]).host == "::"


def test_build_corpus_with_a_models_tokenizer(clean_env, tmp_path, capsys):
    model = tmp_path / "model"
    Tokenizer.train(texts=["def f(x):\n    return x\n"] * 10, vocab_size=270).save_pretrained(model)
    assert main(["build-corpus", "--tokenizer", str(model), "--out", str(tmp_path / "c"), "--max-files", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokenizer_sha256"] == Tokenizer.from_pretrained(model).sha256 and summary["files"] == 4
    (tmp_path / "bare").mkdir()
    assert main(["build-corpus", "--tokenizer", str(tmp_path / "bare"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bare has no tokenizer.json" in err and not (tmp_path / "d").exists()


def test_train_drafter_refuses_a_corpus_in_other_token_ids(clean_env, tmp_path, capsys):
    from tether.server.train.corpus import build_corpus

    build_corpus(tmp_path / "corpus", max_files=4, vocab_size=300, progress=False)  # tether's own BPE
    target = tmp_path / "target"
    Tokenizer.train(texts=["something else entirely\n"] * 10, vocab_size=270).save_pretrained(target)
    argv = ["train-drafter", "--target", str(target), "--data", str(tmp_path / "corpus"), "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"build-corpus --tokenizer {target}" in err
    assert not (tmp_path / "d").exists()  # refused before anything was written
