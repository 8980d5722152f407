"""The sampling controls on the client's side (tether.client.controls): `tether-client` flags map onto ClientConfig,
a bad value is one line and status 2 before anything is dialled, SamplingParams carry the controls to a server that
applies them and a server that does not is refused, and the end-of-text ids of every client path are all the
server names (ModelInfo.eos_ids, else eos_id, else the tokenizer's) with the request's stop token ids."""

import pytest
from toy_models import toy_model_dir

from tether.client.cli import _config, build_parser, main
from tether.client.controls import ControlsNotOffered, check_controls, sampling_params, stop_ids
from tether.client.errors import ServerDataError
from tether.client.pairing_checks import MAX_EOS_IDS, served_tokenizer
from tether.client.session_types import ClientConfig
from tether.shared.logits_processing import ControlError
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb

TOKENIZER = toy_model_dir() / "tokenizer.json"
CONTROLS = dict(top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
                logit_bias=((13, -100.0), (7, 2.5)), stop_token_ids=(2, 9))  # fmt: skip


def test_the_flags_map_onto_the_config():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--top-k", "5", "--min-p", "0.1",
                                      "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
                                      "--repetition-penalty", "1.3", "--logit-bias", "13=-100", "--logit-bias",
                                      "7=2.5", "--stop-token-ids", "2", "--stop-token-ids", "9"])  # fmt: skip
    cfg = _config(args)
    assert {name: getattr(cfg, name) for name in CONTROLS} == CONTROLS
    cfg.check()
    plain = _config(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert (plain.logit_bias, plain.stop_token_ids, plain.repetition_penalty) == ((), (), 1.0)


def test_the_list_controls_come_from_their_variables_too(monkeypatch):
    monkeypatch.setenv("TETHER_LOGIT_BIAS", "13=-100 7=2.5")
    monkeypatch.setenv("TETHER_STOP_TOKEN_IDS", "2 9")
    cfg = _config(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert (cfg.logit_bias, cfg.stop_token_ids) == (((13, -100.0), (7, 2.5)), (2, 9))
    cfg = _config(build_parser().parse_args(["generate", "--prompt", "x", "--stop-token-ids", "4"]))
    assert cfg.stop_token_ids == (4,)  # the command line wins


@pytest.mark.parametrize(
    "flags,named",
    [(["--presence-penalty", "2.5"], "presence_penalty"), (["--repetition-penalty", "0"], "repetition_penalty"),
     (["--min-p", "1.5"], "min_p"), (["--logit-bias", "3=101"], "logit_bias"),
     (["--logit-bias", "3=1", "--logit-bias", "3=2"], "logit_bias"), (["--stop-token-ids", "-1"], "stop_token_ids")],
)  # fmt: skip
def test_a_bad_control_is_one_line_and_status_2_before_anything_is_dialled(flags, named, capsys):
    # No server listens at this address: the controls are checked first, so the error is theirs.
    assert main(["generate", "--prompt", "x", "--server", "127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "connecting" not in err


def test_a_malformed_bias_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "x", "--logit-bias", "13"])
    assert done.value.code == 2 and "expected ID=BIAS" in capsys.readouterr().err


def test_sampling_params_carry_the_controls_to_a_server_that_applies_them():
    cfg = ClientConfig(temperature=0.7, top_p=0.9, seed=4, **CONTROLS)
    p = sampling_params(cfg, pb.ModelInfo(sampling_controls=True))
    assert (p.top_k, p.seed, p.HasField("repetition_penalty")) == (5, 4, True)
    assert p.min_p == pytest.approx(0.1) and p.repetition_penalty == pytest.approx(1.3)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.25)
    assert dict(p.logit_bias) == {13: -100.0, 7: 2.5} and list(p.stop_token_ids) == [2, 9]
    # Unset, repetition_penalty means 1 (off): a config without it leaves the field out.
    assert not sampling_params(ClientConfig(), pb.ModelInfo(sampling_controls=True)).HasField("repetition_penalty")
    # An older server is sent the fields it knows only (a client with controls is refused first: below).
    old = sampling_params(ClientConfig(temperature=0.7, top_k=3), pb.ModelInfo())
    assert old == pb.SamplingParams(temperature=0.7, top_p=1.0, top_k=3)


def test_a_server_that_does_not_apply_the_controls_is_refused_when_one_is_set():
    older = pb.ModelInfo()
    check_controls(ClientConfig(temperature=0.7, top_k=3), older, 100)  # the rule every server applies
    for name, value in [*CONTROLS.items()][1:]:
        with pytest.raises(ControlsNotOffered, match=name):
            check_controls(ClientConfig(**{name: value}), older, 100)
    check_controls(ClientConfig(**CONTROLS), pb.ModelInfo(sampling_controls=True), 100)
    with pytest.raises(ControlError) as e:
        check_controls(ClientConfig(logit_bias=((100, 1.0),)), pb.ModelInfo(sampling_controls=True), 100)
    assert e.value.control == "logit_bias"
    with pytest.raises(ControlError) as e:
        check_controls(ClientConfig(stop_token_ids=(100,)), pb.ModelInfo(sampling_controls=True), 100)
    assert e.value.control == "stop_token_ids"


def test_every_end_of_text_id_the_server_names_ends_a_generation():
    text = TOKENIZER.read_text()
    own = Tokenizer.from_json(text)
    assert own.eos_ids == (own.eos_id,)
    listed = served_tokenizer(text, pb.ModelInfo(eos_id=5, eos_ids=[5, 17, 23]))
    assert listed.eos_ids == (5, 17, 23)
    assert stop_ids(ClientConfig(stop_token_ids=(40,)), pb.ModelInfo(eos_id=5, eos_ids=[5, 17, 23]), own) == {
        5, 17, 23, 40}  # fmt: skip
    assert stop_ids(ClientConfig(), pb.ModelInfo(), own) == set(own.eos_ids)
    assert served_tokenizer(text, pb.ModelInfo(eos_ids=[17, 23])).eos_ids == (17, 23)  # eos_id unset: the first
    assert served_tokenizer(text, pb.ModelInfo(eos_id=5)).eos_ids == (5,)  # a server before eos_ids
    assert served_tokenizer(text, pb.ModelInfo()).eos_ids == own.eos_ids  # before eos_id: the tokenizer's own
    with pytest.raises(ValueError, match="outside the vocabulary"):
        served_tokenizer(text, pb.ModelInfo(eos_ids=[5, own.vocab_size]))
    with pytest.raises(ServerDataError, match="end-of-text ids"):
        served_tokenizer(text, pb.ModelInfo(eos_ids=range(MAX_EOS_IDS + 1)))
