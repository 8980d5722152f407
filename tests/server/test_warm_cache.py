"""The warm-start cache (tether.server.warm_cache) and how `serve` / `warm` use it.

- `use_cache_dir` routes Triton's own cache manager (the one that stores compiled kernels, launchers and autotuning
  results) to DIR/triton, in this process and in a process it starts; an unusable directory is refused.
- The graph-shapes file round-trips, keeps other keys, is replaced atomically, and a corrupt or foreign file is
  ignored with a warning.
- `serve` and `warm` parse --cache-dir; `warm` fills a cache that the next `serve` then finds: its ready line says
  cold, then warm. No GPU here: the kernel warm-up is a stand-in that does what Triton does on one (write what the
  cache lacks, find the rest), so what is tested is the wiring and the cold/warm bookkeeping, not Triton's compiler.
"""

import json
import logging
import os
import re
import subprocess
import sys
import threading

import pytest
import triton
from toy_models import toy_model_flags

from tether.kernels import utils as kernel_utils
from tether.server import daemon, engine_core, model_loading, warm_cache
from tether.server.cli import build_parser, main
from tether.server.kv_pool import KVPool
from tether.server.serve_config import ServeConfig
from tether.server.warm_cache import SHAPES_FILE, load_shapes, record_shapes, use_cache_dir
from tether.shared.cli_support import build_config


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test's Triton cache setting, TRITON_CACHE_DIR, chosen root and "tether" logger are put back after it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "/nonexistent/inherited")  # restored (or removed) by monkeypatch
    monkeypatch.setattr(warm_cache, "_current", None)
    logger = logging.getLogger("tether")
    saved = logger.handlers[:], logger.level, logger.propagate
    with triton.knobs.cache.scope():
        yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


# ---- the Triton cache directory ----------------------------------------------------------------------------------


def test_use_cache_dir_sends_tritons_cache_manager_there(tmp_path):
    from triton.runtime.cache import get_cache_manager

    kernels = use_cache_dir(tmp_path / "c")
    assert kernels == tmp_path / "c" / "triton" and kernels.is_dir()
    assert warm_cache.kernel_cache_dir() == kernels and warm_cache.current_dir() == tmp_path / "c"
    assert os.environ["TRITON_CACHE_DIR"] == str(kernels)  # the inherited value lost to the flag
    # What compile(), the launcher build and the autotuner's disk cache all write through.
    stored = get_cache_manager("0" * 64).put(b"cubin", "kernel.cubin")
    assert os.path.dirname(os.path.dirname(stored)) == str(kernels)
    assert warm_cache.count_entries(kernels) == 1


def test_a_started_process_inherits_the_cache_dir(tmp_path):
    """--tp followers are spawned processes: they compile into the same directory."""
    kernels = use_cache_dir(tmp_path)
    code = "import triton; print(triton.knobs.cache.dir)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == str(kernels)


def test_an_unusable_cache_dir_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cache directory"):
        use_cache_dir(tmp_path / "file" / "sub")
    assert os.environ["TRITON_CACHE_DIR"] == "/nonexistent/inherited"  # nothing changed


def test_count_entries_counts_files_not_directories(tmp_path):
    assert warm_cache.count_entries(tmp_path / "missing") == 0
    (tmp_path / "a" / "b").mkdir(parents=True)  # Triton makes a directory for every key it looks up
    assert warm_cache.count_entries(tmp_path) == 0
    (tmp_path / "a" / "b" / "k.json").write_text("{}")
    (tmp_path / "a" / "x.cubin").write_bytes(b"")
    assert warm_cache.count_entries(tmp_path) == 2


# ---- graph shapes ----------------------------------------------------------------------------------------------------


def test_shapes_round_trip_and_keep_other_keys(tmp_path):
    assert load_shapes(tmp_path, "a") == []  # no file yet
    path = record_shapes(tmp_path / "new", "a", [(1, 8), [4, 8]])
    assert path == tmp_path / "new" / SHAPES_FILE
    record_shapes(tmp_path / "new", "b", [[32]])
    assert load_shapes(tmp_path / "new", "a") == [[1, 8], [4, 8]]
    assert load_shapes(tmp_path / "new", "b") == [[32]]
    record_shapes(tmp_path / "new", "a", [])
    assert load_shapes(tmp_path / "new", "a") == [] and load_shapes(tmp_path / "new", "b") == [[32]]
    assert load_shapes(tmp_path / "new", "missing") == []


def test_the_file_name_never_comes_from_the_key(tmp_path):
    record_shapes(tmp_path / "root", "../../escape", [[1]])
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [SHAPES_FILE]
    assert load_shapes(tmp_path / "root", "../../escape") == [[1]]


@pytest.mark.parametrize("shapes", [[[1.5]], [[-1]], [[True]], [["8"]], [8]])
def test_bad_shapes_and_keys_are_refused_before_writing(tmp_path, shapes):
    with pytest.raises(ValueError):
        record_shapes(tmp_path, "k", shapes)
    with pytest.raises(ValueError):
        record_shapes(tmp_path, "", [[1]])
    assert not (tmp_path / SHAPES_FILE).exists()


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "\xff\xfe",
        json.dumps([1, 2]),
        json.dumps({"version": 2, "shapes": {"k": [[1]]}}),
        json.dumps({"version": 1, "shapes": {"k": [[1, "x"]]}}),
        json.dumps({"version": 1, "shapes": [[1]]}),
    ],
    ids=["truncated", "not-utf8", "list", "version", "bad-dim", "shapes-list"],
)
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(tmp_path, text, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("tether"), "propagate", True)  # configure_logging may have turned it off
    (tmp_path / SHAPES_FILE).write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    with caplog.at_level(logging.WARNING, logger="tether.server"):
        assert load_shapes(tmp_path, "k") == []
    assert "ignoring the graph shapes file" in caplog.text
    record_shapes(tmp_path, "k", [[2, 3]])  # a record after it starts a fresh file
    assert load_shapes(tmp_path, "k") == [[2, 3]]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    record_shapes(tmp_path, "k", [[1]])
    before = (tmp_path / SHAPES_FILE).read_bytes()

    def half_then_fail(obj, f, **kw):
        f.write('{"version": 1, "sha')
        raise OSError("disk full")

    monkeypatch.setattr(warm_cache.json, "dump", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        record_shapes(tmp_path, "k", [[2]])
    assert (tmp_path / SHAPES_FILE).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [SHAPES_FILE]
    monkeypatch.undo()
    assert load_shapes(tmp_path, "k") == [[1]]


# ---- serve and warm --------------------------------------------------------------------------------------------------


def test_serve_and_warm_parse_cache_dir():
    parser = build_parser()
    assert parser.parse_args(["serve"]).cache_dir == ""
    assert parser.parse_args(["serve", "--cache-dir", "/c"]).cache_dir == "/c"
    args = parser.parse_args(["warm", "--cache-dir", "/c", "--model", "m", "--dtype", "float32", "--device", "cuda"])
    assert (args.command, args.cache_dir, args.model, args.dtype, args.device) == ("warm", "/c", "m", "float32", "cuda")
    with pytest.raises(SystemExit):  # warm takes only the flags that decide which kernels compile
        parser.parse_args(["warm", "--port", "1"])


def test_warm_without_the_triton_backend_is_an_error(capsys, tmp_path):
    argv = ["warm", *toy_model_flags(), "--device", "cpu", "--attention", "reference", "--cache-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "nothing to warm" in capsys.readouterr().err


KERNELS = ("prefill_G4_D32.cubin", "prefill_G4_D32.autotune.json", "verify_split.cubin", "__triton_launcher.so")


@pytest.fixture
def gpu_warm_up(monkeypatch) -> list:
    """The models load as the "triton" backend on the CPU (they never run), and the kernel warm-up is a stand-in
    for Triton on a GPU: it writes into Triton's current cache each kernel that is not there yet."""
    monkeypatch.setattr(model_loading, "attention_backend", lambda device, requested="auto": "triton")
    monkeypatch.setattr(daemon, "attention_backend", lambda device, requested="auto": "triton")
    monkeypatch.setattr(kernel_utils, "interpreting", lambda: False)
    pools = []

    def warm_up(target, pool, drafter=None):
        assert drafter is not None  # serve's rounds deliver deltas: the drafter's server part is warmed with them
        pools.append(pool)
        for name in KERNELS:
            path = warm_cache.kernel_cache_dir() / name.split(".")[0] / name
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"compiled")

    monkeypatch.setattr(engine_core, "warm_up", warm_up)
    return pools


def serve_once(monkeypatch, *argv: str) -> int:
    """`tether-server serve --port 0 ...` in this thread, stopped once it is ready (SIGTERM's handler, called)."""
    handlers, ready = {}, threading.Event()

    class Signals:  # serve's signal.signal(): keep the handlers instead of installing them
        SIGTERM, SIGINT = "SIGTERM", "SIGINT"

        @staticmethod
        def signal(sig, handler):
            handlers[sig] = handler

    monkeypatch.setattr(daemon, "signal", Signals)
    stopper = threading.Thread(target=lambda: ready.wait(120) and handlers.get("SIGTERM", lambda: None)())
    stopper.start()
    args = build_parser().parse_args(
        ["serve", *toy_model_flags(), "--port", "0", "--device", "cpu", "--kv-pool-mb", "8", *argv]
    )
    try:
        return daemon.serve(build_config(ServeConfig, args), ready=ready)
    finally:
        ready.set()
        stopper.join()


def ready_line(err: str) -> str:
    (line,) = [ln for ln in err.splitlines() if " ready in " in ln]
    return line


def test_warm_fills_the_cache_and_the_next_serve_starts_warm(tmp_path, monkeypatch, capsys, gpu_warm_up):
    cache = tmp_path / "cache"
    assert main(["warm", *toy_model_flags(), "--device", "cpu", "--kv-pool-mb", "8", "--cache-dir", str(cache)]) == 0
    out, err = capsys.readouterr()
    assert re.fullmatch(rf"warmed {re.escape(str(cache / 'triton'))} in [\d.]+ s \(cold cache\)\n", out), out
    assert warm_cache.count_entries(cache / "triton") == len(KERNELS)
    assert isinstance(gpu_warm_up[0], KVPool)  # the warm-up ran against a real pool, as serve's does
    assert re.search(r"warm-up: .* \(cold cache: 4 new files in .*, 0 before\)", err), err

    assert serve_once(monkeypatch, "--cache-dir", str(cache)) == 0
    out, err = capsys.readouterr()
    assert out.startswith("listening on 127.0.0.1:") and out.endswith("stopped\n")
    assert re.search(rf"kernel cache {re.escape(str(cache / 'triton'))}: 4 files", err), err
    assert re.search(r"models loaded in [\d.]+ s", err), err
    assert re.search(r"ready in [\d.]+ s \(warm cache\)", ready_line(err)), err
    assert warm_cache.count_entries(cache / "triton") == len(KERNELS)


def test_serve_on_an_empty_cache_dir_logs_a_cold_start_in_json(tmp_path, monkeypatch, capsys, gpu_warm_up):
    assert serve_once(monkeypatch, "--cache-dir", str(tmp_path), "--log-format", "json") == 0
    records = [json.loads(ln) for ln in capsys.readouterr().err.splitlines() if ln.startswith("{")]
    (ready,) = [r for r in records if r.get("event") == "ready"]
    assert ready["kernel_cache"] == "cold cache" and ready["ready_s"] >= 0 and ready["level"] == "info"
    (warm,) = [r for r in records if r.get("event") == "warm_up"]
    assert warm["cache_files_added"] == len(KERNELS)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_serve_without_kernels_says_so(tmp_path, monkeypatch, capsys):
    """The reference backend compiles nothing: no warm-up, and the ready line claims no cache state."""
    assert serve_once(monkeypatch, "--attention", "reference", "--cache-dir", str(tmp_path)) == 0
    line = ready_line(capsys.readouterr().err)
    assert re.search(r"ready in [\d.]+ s \(no kernel warm-up\)", line), line


def test_serve_exports_the_onnx_precisions_asked_into_the_cache_dir(tmp_path, monkeypatch, capsys):
    """--onnx-precisions exports before the port opens, into --cache-dir/onnx (tether.server.client_export)."""
    args = ("--attention", "reference", "--cache-dir", str(tmp_path))
    assert serve_once(monkeypatch, *args, "--onnx-precisions", "int8") == 0
    assert "ONNX client part (int8) ready" in capsys.readouterr().err
    # int8 is derived from the fp32 export, which stays for the next start and the next precision
    assert sorted(p.name for p in (tmp_path / "onnx").glob("*/*")) == ["fp32", "int8"]
    with pytest.raises(ValueError, match="onnx-precisions"):
        serve_once(monkeypatch, *args, "--onnx-precisions", "fp32,int4")
