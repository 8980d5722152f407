"""Tiny random models the tests share: fast, awkwardly sized, and far from uniform so that bugs show."""

import dataclasses

import torch

from tether.shared.config import PRESETS
from tether.shared.drafter import DrafterConfig, build_drafter
from tether.shared.model import Transformer


def tiny_target(seed: int = 0, std: float = 0.15, **overrides) -> Transformer:
    """The "tiny" preset (with overrides), its matrices redrawn with a larger std than the training init."""
    torch.manual_seed(seed)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


def tiny_moa_drafter(target: Transformer, tli: int = 1):
    return build_drafter(target, DrafterConfig(kind="moa", tli=tli, n_heads=4, n_kv_heads=2, head_dim=12)).eval()


def tiny_pair(kind: str, vocab_size: int, tli: int = 1):
    """A tiny target of `vocab_size` and a drafter of `kind` ("moa" or "eagle") whose matrices are redrawn far from
    their near-zero init, so that a wrong row or position shows in the logits."""
    target = tiny_target(vocab_size=vocab_size)
    if kind == "moa":
        drafter = tiny_moa_drafter(target, tli=tli)
    else:
        torch.manual_seed(1)
        drafter = build_drafter(target, DrafterConfig(kind="eagle", n_heads=4, n_kv_heads=2, head_dim=12)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return target, drafter
