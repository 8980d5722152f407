"""The bench programs (bench/*.py) are scripts, not a package: their smoke tests load one by its path."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py, executed as the module `bench_<name>` (its main() is what the tests call)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module
