"""A Hugging Face hub cache written by hand, as `hf download` leaves it: models--OWNER--NAME/refs/REVISION holding
the commit, snapshots/COMMIT/ holding the files. What tether.shared.model_source resolves hub ids in, offline."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tiny_models import write_hf_checkpoint


def cache_hub_model(cache: Path, repo_id: str, kind: str = "qwen2", revision: str = "main") -> Path:
    """Write a tiny `kind` checkpoint as `repo_id` at `revision` in the hub cache `cache`; returns its snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    write_hf_checkpoint(snapshot, kind)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
