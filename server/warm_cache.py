"""The server's warm-start cache: one directory that keeps what a start would otherwise redo, across restarts.

Purpose: `serve` compiles and autotunes its Triton kernels at every start (tether.server.batcher.warm_up): for the
default models on an H200, 34 s in bfloat16 and 95 s in float32 when nothing is cached, 2 s when everything is.
Triton keeps compiled kernels, their C launchers and (with `cache_results=True` on the autotuner, as
kernels/utils.py's AUTOTUNE_CACHE sets) autotuning results in one on-disk cache, by default under $HOME/.triton, which a
container loses at every restart. Pointing that cache at a persistent directory makes every start after the first
a warm one.

Contract:
- `use_cache_dir(root)` creates `root` (it must end up writable, else ValueError) and points Triton's cache at
  `root/triton`, before anything compiles: through `triton.knobs.cache.dir` where the knob exists (Triton 3.4+,
  read at each compile) and through TRITON_CACHE_DIR too (older Triton reads that at each compile, and spawned
  processes such as tensor-parallel followers inherit it). The directory wins over an inherited TRITON_CACHE_DIR.
  Nothing else needs pointing: the server never uses torch.compile, so torch inductor keeps no cache of ours.
- `kernel_cache_dir()`: the directory Triton writes to now; `count_entries(dir)`: the files under it. A warm-up
  that adds no file found everything it needed in the cache (Triton writes only on a miss): a warm start.
- `record_shapes(root, key, shapes)` / `load_shapes(root, key)`: a small JSON file (`root/graph-shapes.json`,
  a fixed name) of shape lists by key, for code that captures CUDA graphs and wants to capture the same shapes
  at the next start. Writes replace the file atomically (temporary file + rename): a reader sees the old file or
  the new one, never half of one; two writers at once may lose one key's update (last writer wins). A file that
  is not what this module writes is ignored with a warning (load returns [] and the next record starts afresh).
  Keys should name what the shapes depend on (model fingerprint, dtype, device).
- `current_dir()`: the root `use_cache_dir` set in this process, or None.

    use_cache_dir("/var/cache/tether")          # before the first compile
    n = count_entries(kernel_cache_dir())
    record_shapes("/var/cache/tether", "fp:abc/bf16", [[1, 8], [4, 8]])
    load_shapes("/var/cache/tether", "fp:abc/bf16")    # [[1, 8], [4, 8]]

`tether-server serve --cache-dir DIR` and `tether-server warm --cache-dir DIR` call `use_cache_dir`; tests:
`.venv/bin/python -m pytest -q tests/server/test_warm_cache.py`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("tether.server")

TRITON_SUBDIR = "triton"  # Triton's kernel + autotune cache, under the root
SHAPES_FILE = "graph-shapes.json"  # the shapes file's name, under the root (never taken from anyone's input)
SHAPES_VERSION = 1

_current: Path | None = None


def use_cache_dir(root: str | os.PathLike) -> Path:
    """Point Triton's cache at root/triton (created); returns that directory. Call before the first compile."""
    global _current
    root = Path(root).expanduser().absolute()
    triton_dir = root / TRITON_SUBDIR
    try:
        triton_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cache directory {root}: {e.strerror or e}") from e
    if not os.access(triton_dir, os.W_OK | os.X_OK):
        raise ValueError(f"cache directory {triton_dir} is not writable")
    os.environ["TRITON_CACHE_DIR"] = str(triton_dir)
    knobs = _triton_cache_knobs()
    if knobs is not None:
        knobs.dir = str(triton_dir)
    _current = root
    return triton_dir


def current_dir() -> Path | None:
    """The root use_cache_dir set in this process (None: Triton's own default, and no shapes are kept)."""
    return _current


def kernel_cache_dir() -> Path:
    """Where Triton reads and writes its cache now."""
    knobs = _triton_cache_knobs()
    if knobs is not None:
        return Path(knobs.dir)
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def count_entries(directory: str | os.PathLike) -> int:
    """Files under `directory` (0 when it does not exist)."""
    return sum(len(files) for _, _, files in os.walk(directory))


def _triton_cache_knobs():
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs, "cache", None)


# ---- graph shapes ---------------------------------------------------------------------------------------------------


def _valid_dim(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _valid_shapes(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(s, list) and all(map(_valid_dim, s)) for s in value)


def _read(path: Path) -> dict[str, list[list[int]]]:
    """The file's shapes by key; {} when it is missing, and {} with a warning when it is not ours."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("ignoring the graph shapes file %s: %s", path, e)
        return {}
    shapes = data.get("shapes") if isinstance(data, dict) and data.get("version") == SHAPES_VERSION else None
    if not isinstance(shapes, dict) or not all(_valid_shapes(v) for v in shapes.values()):
        log.warning("ignoring the graph shapes file %s: not a version %d shapes file", path, SHAPES_VERSION)
        return {}
    return shapes


def load_shapes(root: str | os.PathLike, key: str) -> list[list[int]]:
    """The shapes recorded under `key` in root/graph-shapes.json; [] when none (or the file is unreadable)."""
    return _read(Path(root) / SHAPES_FILE).get(key, [])


def record_shapes(root: str | os.PathLike, key: str, shapes: Sequence[Sequence[int]]) -> Path:
    """Store `shapes` under `key` in root/graph-shapes.json (other keys kept), atomically; returns the file."""
    if not isinstance(key, str) or not key:
        raise ValueError("a shapes key must be a non-empty string")
    shapes = [list(s) if isinstance(s, list | tuple) else s for s in shapes]
    if not _valid_shapes(shapes):
        raise ValueError(f"shapes must be lists of non-negative ints: {shapes!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / SHAPES_FILE
    data = {"version": SHAPES_VERSION, "shapes": _read(path) | {key: shapes}}
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{SHAPES_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
