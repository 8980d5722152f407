"""`tether-server generate` with the sampling controls: its flags reach the rule (speculative decoding with the
toy drafter writes what the target's own decoding with the same controls writes), a stop token ends the text,
and a value out of range is one line naming the flag, exit status 2, before anything is echoed."""

import json
import os

import pytest
import torch
from toy_models import toy_model_dir, toy_model_flags

from tether.server.cli import main
from tether.server.model_loading import load
from tether.shared import env
from tether.shared.logits_processing import SamplingControls

ARGS = ["generate", *toy_model_flags(), "--device", "cpu", "--prompt", "import os\nimport", "--max-new-tokens", "24",
        "--json"]  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


def run(capsys, *flags: str) -> dict:
    assert main([*ARGS, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_with_controls_equals_the_targets_own_decoding_with_them(clean_env, capsys):
    target, tok = load(toy_model_dir(), "cpu")
    plain = run(capsys)["token_ids"]
    got = run(capsys, "--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--logit-bias", f"{plain[1]}=-100")
    controls = SamplingControls(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={plain[1]: -100})
    prompt = torch.tensor([tok.encode("import os\nimport")])
    assert got["token_ids"] == list(target.generate(prompt, 24, controls=controls, stop_ids=tok.eos_ids))
    assert got["token_ids"] != plain and plain[1] not in got["token_ids"]
    stop = plain[3]
    ended = run(capsys, "--stop-token-ids", str(stop))
    assert ended["token_ids"] == plain[: plain.index(stop) + 1]


@pytest.mark.parametrize("flags,name", [(["--min-p", "2"], "--min-p"),
                                        (["--repetition-penalty", "0"], "--repetition-penalty"),
                                        (["--logit-bias", "1=500"], "--logit-bias")])  # fmt: skip
def test_a_control_out_of_range_is_one_line_naming_the_flag(clean_env, capsys, flags, name):
    assert main([*ARGS[:-1], *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and name in err


def test_generate_records_its_step_graphs_for_the_next_run(clean_env, capsys, tmp_path):
    """As serve does when it stops: a generation that ends keeps its step graphs' shapes (Engine.record_shapes), so
    the next run's warm-up captures them before it decodes (on a GPU; a CPU engine records none)."""
    from tether.server.engine_core import Engine

    recorded = []
    clean_env.setattr(Engine, "record_shapes", lambda self: recorded.append(self.target.cfg.vocab_size))
    run(capsys, "--cache-dir", str(tmp_path / "cache"))
    assert len(recorded) == 1
    assert main([*ARGS, "--min-p", "2"]) == 2  # refused before anything loads: nothing to record
    capsys.readouterr()
    assert len(recorded) == 1
