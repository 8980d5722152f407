"""Where a model flag's files are: a local folder, or a Hugging Face hub id already in this machine's cache.

Users keep their models in the Hugging Face cache (`hf download meta-llama/Llama-3.2-1B` puts them there), so a
model flag (`tether-server serve --model`, `generate`, `warm`; `--drafter` too) takes either:
- a directory, used as it is;
- a hub id (`owner/name`) that is not a directory here: resolved with huggingface_hub's offline lookup
  (`snapshot_download(..., local_files_only=True)`) in its cache, which honours HF_HOME and HF_HUB_CACHE, at
  `revision` (a branch, tag or commit; empty: main). Nothing is downloaded, ever: a hub id that is not cached is a
  CommandError (Refusal.NOT_CACHED) saying so and how to fetch it, one line, before torch is imported.
Either way the folder is then checked for the files the flag needs (tether.shared.cli_support.check_model_dir).

Contract: `resolve_model_dir(flag, name, needs, revision="", cache_dir=None) -> ModelSource`: `path` the local
folder, `hub_id` the id it was found under (None for a folder named directly), `commit` the snapshot's commit.
huggingface_hub is imported only for a hub id; an install without it (the edge, `make demo`) answers a hub id with
what to install.

    src = resolve_model_dir("--model", "Qwen/Qwen2.5-0.5B", TARGET_FILES)
    model, tok = load(src.path, "cuda")

Tests: tests/shared/test_model_source.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tether.shared.cli_support import HUB_ID, CommandError, Refusal, check_model_dir


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the local folder the files are read from
    hub_id: str | None = None  # the hub id it was resolved from; None when the flag named a folder
    commit: str | None = None  # the cached snapshot's commit, for a hub id


def resolve_model_dir(
    flag: str, name: str, needs: Sequence[Sequence[str]] = (), revision: str = "", cache_dir: str | Path | None = None
) -> ModelSource:
    """See the module docstring."""
    if Path(name).expanduser().exists() or not HUB_ID.fullmatch(name):
        check_model_dir(flag, name, needs)
        return ModelSource(Path(name).expanduser())
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CommandError(
            Refusal.HUB_ID,
            f"{flag} {name}: no such directory; a hub id is read from the Hugging "
            "Face cache with huggingface_hub (pip install huggingface_hub), or pass a folder",
        ) from None
    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    at = f" at revision {revision}" if revision else ""
    try:
        snapshot = Path(snapshot_download(name, revision=revision or None, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise CommandError(
            Refusal.NOT_CACHED,
            f"{flag} {name}: no such directory, nor a model{at} in the Hugging "
            f"Face cache ({cache}); tether downloads nothing: fetch it with `hf download {name}"
            f"{f' --revision {revision}' if revision else ''}` or pass a folder",
        ) from None
    try:
        check_model_dir(flag, str(snapshot), needs)
    except CommandError as e:
        raise CommandError(e.reason, f"{e} (the cached snapshot of {name}{at})") from None
    return ModelSource(snapshot, hub_id=name, commit=snapshot.name)
