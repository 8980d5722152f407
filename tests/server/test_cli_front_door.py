"""The command lines' front door (issue #42): what a new user meets before anything is served or generated.

A port that another process holds stops `tether-server serve` in one line before the models load (even a holder
that shares its port through SO_REUSEPORT, as front ends do), and the in-process server binds without that option;
ports out of range are refused when parsing; a bad --model / --drafter / --target is reported before torch is
imported, saying what it is (missing, a hub id, empty, incomplete); --device cuda on a machine without CUDA is one
line; `generate` echoes the prompt only once decoding starts and reports time to first token from the command's
start as well as from the models being ready. Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import grpc
import pytest
import torch
from hub_cache import cache_hub_model
from toy_models import toy_model_flags

from tether.server.cli import main
from tether.server.rpc_server import event_loop, make_server
from tether.server.serve_config import ServiceConfig
from tether.shared import env
from tether.shared.cli_support import CommandError, Refusal, address_in_use
from tether.v1 import tether_pb2_grpc


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port an unrelated process might hold: listening, with SO_REUSEPORT (as a front end of another server)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def tether_server(*args: str) -> subprocess.CompletedProcess:
    exe = [sys.executable, "-c", "import sys; from tether.server.cli import main; sys.exit(main(sys.argv[1:]))"]
    return subprocess.run([*exe, *args], capture_output=True, text=True, timeout=300)


# ---- ports -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--frontends", "2"]], ids=["one-process", "front-ends"])
def test_a_port_in_use_is_one_line_before_the_models_load(held_port, extra):
    flags = ["--port", str(held_port), "--device", "cpu", "--log-level", "warning", *extra]
    run = tether_server("serve", *toy_model_flags(), *flags)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.count("\n") == 1 and f"--port {held_port}: 127.0.0.1:{held_port} is in use" in run.stderr


def test_a_metrics_port_in_use_is_one_line(held_port):
    run = tether_server("serve", *toy_model_flags(), "--port", "0", "--metrics-port", str(held_port), "--device", "cpu")
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.count("\n") == 1 and f"--metrics-port {held_port}" in run.stderr


def test_an_http_port_taken_after_the_check_is_one_line_after_the_models_load(held_port):
    """The check before the models load and the bind after them are two steps: a port taken in between is refused at
    the bind, in one line, with what start-up took given back (no traceback, no leak warnings at exit)."""
    skip_check = (
        "import sys, tether.server.daemon as d; d.check_ports = lambda cfg: None; "
        "from tether.server.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["serve", *toy_model_flags(), "--port", "0", "--http-port", str(held_port), "--device", "cpu", "--log-level",
            "warning"]  # fmt: skip
    run = subprocess.run([sys.executable, "-c", skip_check, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run
    assert run.stderr.count("\n") == 1 and f"--http-port {held_port}: cannot listen on 127.0.0.1" in run.stderr, run


class Idle(tether_pb2_grpc.TetherServicer):
    """A service that answers nothing: enough for make_server to bind and stop."""

    config = ServiceConfig()

    async def housekeeping(self) -> None:
        pass

    def stop_work(self) -> None:
        pass

    def release_all(self) -> None:
        pass


def test_the_server_binds_without_so_reuseport_and_refuses_a_taken_port():
    server, port = make_server(Idle(), "127.0.0.1:0")
    try:
        assert address_in_use("127.0.0.1", port)
        with pytest.raises(CommandError) as refused:
            make_server(Idle(), f"127.0.0.1:{port}")
        assert refused.value.reason == Refusal.ADDRESS_IN_USE

        async def join() -> int:  # what a second server with gRPC's default (SO_REUSEPORT on) would do
            other = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
            try:
                return other.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                return 0
            finally:
                await other.stop(None)

        assert asyncio.run_coroutine_threadsafe(join(), event_loop()).result() == 0  # it cannot share the port
    finally:
        server.stop(None)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "99999"],
        ["serve", "--port", "-1"],
        ["serve", "--metrics-port", "65536"],
        ["serve", "--http-port", "70000"],
        ["serve", "--http-port", "-2"],
    ],
)
def test_ports_out_of_range_are_refused_when_parsing(clean_env, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "from 0 to 65535" in err, err


def test_a_port_variable_out_of_range_is_refused_and_the_edges_pass(clean_env, capsys):
    from tether.server.cli import build_parser

    clean_env.setenv("TETHER_PORT", "99999")
    with pytest.raises(SystemExit):
        main(["serve"])
    assert "TETHER_PORT (for --port)" in capsys.readouterr().err
    clean_env.delenv("TETHER_PORT")
    args = build_parser().parse_args(["serve", "--port", "0", "--metrics-port", "65535", "--http-port", "-1"])
    assert (args.port, args.metrics_port, args.http_port) == (0, 65535, -1)


def test_netsim_and_client_refuse_ports_out_of_range(clean_env, capsys):
    from tether.client.cli import main as client_main
    from tether.netsim.cli import main as netsim_main

    assert netsim_main(["--listen", "127.0.0.1:99999"]) == 2
    assert client_main(["serve", "--listen", "127.0.0.1:99999"]) == 2
    assert client_main(["generate", "--server", "127.0.0.1:65536", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all("99999" in line or "65536" in line for line in err), err


# ---- model directories -----------------------------------------------------------------------------------------


def test_a_bad_model_directory_is_reported_before_torch_is_imported(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from tether.server.cli import main
        out = []
        for argv in (["serve", "--model", {str(tmp_path / "nope")!r}],
                     ["generate", "--model", "meta-llama/Llama-3.2-1B", "--prompt", "x"],
                     ["warm", "--model", {str(tmp_path / "empty")!r}],
                     ["serve", "--model", {str(tmp_path / "half")!r}],
                     ["generate", "--drafter", {str(tmp_path / "empty")!r}],
                     ["train-drafter", "--target", {str(tmp_path / "nope")!r}]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(argv)
            out.append([rc, err.getvalue()])
        assert "torch" not in sys.modules, "torch was imported"
        print(json.dumps(out))
    """)
    cache = tmp_path / "hub"  # an empty Hugging Face cache: the hub id is not in it
    env = {**os.environ, "HF_HUB_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)  # [status, stderr] of each command line
    assert all(rc == 2 and err.count("\n") == 1 for rc, err in results), results
    missing, hub, empty, half, drafter, target = (err for _, err in results)
    assert "tether-server serve: error: --model" in missing and "nope: no such directory" in missing
    assert f"nor a model in the Hugging Face cache ({cache})" in hub and "hf download meta-llama/Llama-3.2-1B`" in hub
    assert "the directory is empty: no tokenizer.json, config.json, model.safetensors" in empty
    assert "half: no tokenizer.json, model.safetensors (or model.safetensors.index.json) in it" in half
    assert "--drafter" in drafter and "no drafter_config.json, drafter.safetensors" in drafter
    assert "--target" in target and "no such directory" in target


def test_serve_and_generate_take_a_cached_hub_id_and_serve_names_the_model_after_it(clean_env, tmp_path):
    import huggingface_hub.constants

    from tether.server import daemon, generate
    from tether.server.serve_config import model_name

    clean_env.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = cache_hub_model(tmp_path, "tether-test/tiny-llama", "llama", revision="v1")
    seen = []
    clean_env.setattr(daemon, "serve", lambda cfg: seen.append(cfg) or 0)
    clean_env.setattr(generate, "generate_text", lambda cfg, *a, **k: seen.append(cfg) or {"text": ""})
    clean_env.setattr(daemon, "warm", lambda cfg: seen.append(cfg) or 0)
    hub = ["--model", "tether-test/tiny-llama", "--revision", "v1", "--drafter", "none"]
    assert main(["serve", *hub]) == 0 and main(["generate", *hub, "--prompt", "x", "--json"]) == 0
    assert main(["serve", *hub, "--served-model-name", "mine"]) == 0
    assert main(["warm", *hub]) == 0  # warm takes --revision too: it compiles for the same snapshot serve loads
    served, generated, named, warmed = seen
    assert served.model == generated.model == warmed.model == str(snapshot) and served.drafter == "none"
    assert model_name(served) == "tether-test/tiny-llama" and model_name(named) == "mine"


def test_a_model_directory_from_a_variable_is_checked_too(clean_env, tmp_path, capsys):
    clean_env.setenv("TETHER_MODEL", str(tmp_path / "nope"))
    assert main(["serve"]) == 2
    assert "--model" in capsys.readouterr().err
    clean_env.delenv("TETHER_MODEL")
    assert main(["generate", "--drafter", "none", "--model", str(tmp_path)]) == 2  # "none": no drafter to check
    assert "the directory is empty" in capsys.readouterr().err


# ---- devices ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--device", "cuda", "--port", "0", *toy_model_flags()],
        ["warm", "--device", "cuda", *toy_model_flags()],
        ["generate", "--device", "cuda", "--prompt", "x", *toy_model_flags()],
        ["train-target", "--device", "cuda", "--out", "{tmp}/t"],
        ["train-drafter", "--device", "cuda:1", "--out", "{tmp}/d"],
    ],
)
def test_cuda_on_a_machine_without_it_is_one_line(clean_env, tmp_path, capsys, argv):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use --device cpu" in err and f"--device {argv[2]}:" in err, err
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_the_refusal_is_typed(monkeypatch):
    from tether.shared.cli_support import require_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CommandError) as refused:
        require_device("cuda")
    assert refused.value.reason == Refusal.NO_CUDA
    require_device("cpu")


# ---- generate --------------------------------------------------------------------------------------------------


def test_generate_never_echoes_a_prompt_it_fails_on(clean_env, capsys):
    prompt = "def f():\n" * 2000  # past the toy model's context with the tokens asked for
    assert main(["generate", *toy_model_flags(), "--device", "cpu", "--prompt", prompt, "--max-new-tokens", "64"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "exceeds the model's max_seq_len" in err


def test_generate_reports_time_to_first_token_from_the_start_and_from_ready(clean_env, capsys):
    argv = ["generate", *toy_model_flags(), "--device", "cpu", "--prompt", "def f(x):", "--max-new-tokens", "4"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "wall_s", "tokens_per_s", "tau"} <= result.keys()  # the keys it always had
    assert 0 <= result["ttft_s"] <= result["wall_s"]
    assert result["ttft_from_start_s"] >= result["ready_s"] + result["ttft_s"] - 1e-3
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):") and "first token" in err and "from the start" in err
