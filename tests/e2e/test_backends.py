"""The edge client's two backends end to end through a real server.

- onnxruntime (the default: it drafts from the ONNX client part the server exports) agrees with torch: the same
  greedy text, the same rounds and acceptance (so the same drafts) at fp32;
- fp16 and int8 weights download fewer bytes and the text is still the target's greedy text (the target decides
  every token; only the drafts may differ);
- sampling works with it; the drafter runs on the intra-op threads the config asks for;
- a server that does not offer the ONNX part (one older than the client) is refused before anything is downloaded,
  with a typed error (FormatNotOffered) in the library and one line with status 1 from `tether-client generate`.

No link fault here: the deadlines are generous so that a busy machine never makes a slow round look like an outage
(an outage would change the rounds compared)."""

import pytest
from edge_text import generate_text, run_text

from tether.client.cli import main
from tether.client.session import ClientConfig, EdgeSession
from tether.client.transport import FormatNotOffered
from tether.v1 import tether_pb2 as pb

# A shape and a mode not chosen by timings.
PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0, "tree": "chain", "mode": "hybrid"}
PROMPT = "def write_lines(path, lines):\n    "


@pytest.fixture(scope="module")
def address(default_server):
    return default_server[0]


@pytest.fixture(scope="module")
def fp32_onnx(address, tmp_path_factory):
    """The default backend's greedy run (fp32), which the other tests compare against."""
    cfg = ClientConfig(server=address, max_new_tokens=48, cache_dir=str(tmp_path_factory.mktemp("fp32")), **PATIENT)
    return generate_text(cfg, PROMPT)


def test_onnx_and_torch_backends_agree_end_to_end(address, fp32_onnx, tmp_path):
    cfg = ClientConfig(server=address, max_new_tokens=48, backend="torch", cache_dir=str(tmp_path), **PATIENT)
    t, o = generate_text(cfg, PROMPT), fp32_onnx
    assert o.token_ids == t.token_ids
    assert (o.stats.rounds, o.stats.accepted, o.stats.drafted) == (t.stats.rounds, t.stats.accepted, t.stats.drafted)
    assert t.stats.accepted > 0


@pytest.mark.parametrize(("precision", "at_most"), [("fp16", 0.6), ("int8", 0.4)])
def test_smaller_onnx_weights_give_the_same_greedy_text(address, fp32_onnx, tmp_path, precision, at_most):
    cfg = ClientConfig(server=address, max_new_tokens=48, precision=precision, cache_dir=str(tmp_path), **PATIENT)
    result = generate_text(cfg, PROMPT)
    assert result.token_ids == fp32_onnx.token_ids and result.stats.accepted > 0
    assert result.stats.weights_bytes <= at_most * fp32_onnx.stats.weights_bytes


@pytest.mark.parametrize("codec", ["int8", "int4", "int3"])
def test_lossy_delta_codecs_keep_the_greedy_text_for_fewer_bytes(address, fp32_onnx, tmp_path, codec):
    """The client offers its codec and the server sends it: the drafts may differ, the target's text may not."""
    cfg = ClientConfig(server=address, max_new_tokens=48, codec=codec, cache_dir=str(tmp_path), **PATIENT)
    result = generate_text(cfg, PROMPT)
    assert result.token_ids == fp32_onnx.token_ids and result.stats.accepted > 0
    per_token = result.stats.bytes_down / len(result.token_ids)
    assert per_token < 0.75 * fp32_onnx.stats.bytes_down / len(fp32_onnx.token_ids)


def test_onnx_backend_samples(address, tmp_path):
    cfg = ClientConfig(server=address, max_new_tokens=24, temperature=0.8, seed=3, cache_dir=str(tmp_path), **PATIENT)
    result = generate_text(cfg, "import os\n")
    assert len(result.token_ids) == 24 and result.stats.rounds > 0


def test_the_onnx_drafter_runs_on_the_threads_asked_for(address, fp32_onnx, tmp_path):
    cfg = ClientConfig(server=address, max_new_tokens=48, threads=2, cache_dir=str(tmp_path), **PATIENT)
    session = EdgeSession(cfg)
    try:
        result = run_text(session, PROMPT)
        sessions = session.models.drafter.sessions
        assert sessions and {s.get_session_options().intra_op_num_threads for s in sessions.values()} == {2}
    finally:
        session.close()
    assert result.token_ids == fp32_onnx.token_ids and result.stats.accepted > 0
    with pytest.raises(ValueError, match="threads"):
        ClientConfig(threads=-1).check()


@pytest.mark.parametrize(("tree", "top_k", "width"), [("auto", 3, 3), ("tree", 2, 2), ("chain", 3, 0)])
def test_the_onnx_drafter_derives_a_tree_session_for_the_trees_it_may_draft(address, tmp_path, tree, top_k, width):
    cfg = ClientConfig(server=address, cache_dir=str(tmp_path), **{**PATIENT, "tree": tree, "tree_top_k": top_k})
    session = EdgeSession(cfg)
    try:
        drafter = session.pair().drafter
        assert drafter.tree_width == width and ("tree" in drafter.sessions) == (width > 0)
    finally:
        session.close()


@pytest.fixture(scope="module")
def tensors_only(start_server):
    """A server from before the ONNX client part: its model info lists the tensors alone."""

    def tensors_only(service):
        del service.engine.model_info.client_part_formats[:]
        service.engine.model_info.client_part_formats.append(pb.CLIENT_PART_TENSORS)

    return start_server(tensors_only)[0]


def test_a_server_without_the_onnx_part_is_a_typed_refusal(tensors_only, tmp_path, capsys):
    session = EdgeSession(ClientConfig(server=tensors_only, cache_dir=str(tmp_path), **PATIENT))
    try:
        with pytest.raises(FormatNotOffered) as refused:
            session.pair()
    finally:
        session.close()
    assert refused.value.code == "FAILED_PRECONDITION"
    assert not any(tmp_path.iterdir()), "nothing is downloaded before the format is known to be offered"
    argv = ["generate", "--server", tensors_only, "--prompt", "x", "--precision", "int8", "--cache-dir", str(tmp_path)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"connecting to {tensors_only}", err
    assert len(err) == 2 and "--backend torch" in err[1] and "int8" in err[1], err
    # The torch backend still pairs with it.
    cfg = ClientConfig(server=tensors_only, backend="torch", max_new_tokens=8, cache_dir=str(tmp_path), **PATIENT)
    assert len(generate_text(cfg, PROMPT).token_ids) == 8
