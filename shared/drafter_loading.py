"""A drafter of a named kind for a target: built fresh, or loaded from its folder (tether.shared.drafter's files).

Contract: `build_drafter(target, dcfg)` is a new drafter of dcfg.kind ("moa": tether.shared.moa's MoADrafter,
"eagle": tether.shared.eagle's EagleDrafter; another kind is a ValueError naming the known ones). `load_drafter(path,
target, target_fingerprint=...)` reads a drafter folder, refusing one trained for another target, and returns it on
the target's device and dtype in eval mode. This module sits above the kinds, which import tether.shared.drafter.

    drafter = load_drafter("deploy/models/drafter", target, target_fingerprint=fingerprint("deploy/models/target"))
"""

from __future__ import annotations

from pathlib import Path

from tether.shared.drafter import DrafterConfig, load_drafter_config, load_drafter_weights
from tether.shared.eagle import EagleDrafter
from tether.shared.moa import MoADrafter

KINDS = {"moa": MoADrafter, "eagle": EagleDrafter}


def build_drafter(target, dcfg: DrafterConfig):
    """A fresh drafter of dcfg.kind for `target`."""
    if dcfg.kind not in KINDS:
        raise ValueError(f"unknown drafter kind {dcfg.kind!r}; choose one of {', '.join(KINDS)}")
    return KINDS[dcfg.kind](target, dcfg)


def load_drafter(path: str | Path, target, *, target_fingerprint: str | None = None):
    """Load a drafter directory for `target`. With `target_fingerprint` given, refuse a drafter trained for
    another target (the pairing check clients and servers rely on)."""
    dcfg = load_drafter_config(path)
    if target_fingerprint and dcfg.target_fingerprint and dcfg.target_fingerprint != target_fingerprint:
        raise ValueError(
            f"drafter {path} was trained for target {dcfg.target_fingerprint[:12]}, not {target_fingerprint[:12]}"
        )
    drafter = build_drafter(target, dcfg)
    drafter.load_state_dict(load_drafter_weights(path))
    return drafter.to(device=target.device, dtype=target.dtype).eval()
