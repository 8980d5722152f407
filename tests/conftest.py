"""Test configuration. Its presence puts tests/ on sys.path, so test modules share tiny_models.py."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Entry points such as `serve` and `warm` switch autograd off for their thread (what a server process wants);
    run in a test's thread, that must not leak into the tests after it."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)
