"""The client part in the form the session's backend drafts with: what pairing checks before fetching it, the fetch,
and the random streams that backend's drafter samples with.

Contract:
- `check_pairing(cfg, info, address)` -> (ModelConfig, DrafterConfig), before anything is downloaded or allocated:
  refuses a server without a drafter (ServerError, REASON_NO_DRAFTER: stream from it with
  tether.client.server_only), a ModelInfo this client cannot take (tether.client.pairing_checks), sampling controls
  the server does not apply (tether.client.controls), and an ONNX part in a precision the server does not offer
  (FormatNotOffered: use `--backend torch`).
- `fetch_part(cfg, link, info, on_progress)` -> Paired: from the weight cache or the server, the ONNX graphs
  (tether.client.onnx_pairing; no torch anywhere on that path) or, with `--backend torch`, the tensors
  (tether.client.pairing, imported only then: the one part of the client that imports torch). Callers retry it
  (transport.DOWNLOAD_ATTEMPTS); a download goes on from what the cache holds.
- `draft_random(cfg)` -> (the offline tokens' random stream, n -> the session's n-th online draft's): numpy
  generators for onnx, torch ones for torch, seeded from cfg.seed (tether.client.seeds).

    model_cfg, drafter_cfg = check_pairing(cfg, info, link.replicas.address)
    paired = fetch_part(cfg, link, info, on_progress=lambda done, total: None)

Tests: tests/client/test_onnx_pairing.py, tests/e2e/test_backends.py, tests/test_client_install.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from tether.client.controls import check_controls
from tether.client.onnx_pairing import FORMATS, fetch_onnx_part
from tether.client.pairing_checks import check_model_info
from tether.client.seeds import draft_seed
from tether.client.server_link import ServerLink
from tether.client.session_types import ClientConfig, Paired
from tether.client.transport import FormatNotOffered, ServerError
from tether.shared.config import ModelConfig
from tether.shared.drafter_config import DrafterConfig
from tether.v1 import tether_pb2 as pb


def check_pairing(cfg: ClientConfig, info: pb.ModelInfo, address: str) -> tuple[ModelConfig, DrafterConfig]:
    """The target's and drafter's configs from `info`, once it is one this client can pair with (see above)."""
    if info.server_only:
        raise ServerError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{address} runs no drafter (server-only): stream from it with Generate",
            pb.REASON_NO_DRAFTER,
        )
    model_cfg, drafter_cfg = check_model_info(info)  # before anything is downloaded or allocated
    check_controls(cfg, info, model_cfg.vocab_size)
    if cfg.backend == "onnx" and FORMATS[cfg.precision] not in info.client_part_formats:
        raise FormatNotOffered(
            f"{cfg.server} does not offer the ONNX client part in {cfg.precision} (a server "
            "older than this client): pass --backend torch, or upgrade the server"
        )
    return model_cfg, drafter_cfg


def fetch_part(
    cfg: ClientConfig, link: ServerLink, info: pb.ModelInfo, on_progress: Callable[[int, int], None]
) -> Paired:
    """The client part for cfg.backend, from the cache or over `link` (see above)."""
    if cfg.backend == "onnx":
        tree_width = 0 if cfg.tree == "chain" else cfg.tree_top_k  # a chain-only client derives no tree session
        part = fetch_onnx_part(
            link.stub,
            info,
            cfg.cache_dir,
            precision=cfg.precision,
            metadata=link.metadata,
            max_bytes=cfg.max_weights_mb << 20,
            on_progress=on_progress,
            threads=cfg.threads,
            tree_width=tree_width,
        )
        return Paired(info, part.tokenizer, part.drafter, part.nbytes)
    from tether.client.pairing import build_client_models, fetch_client_part

    tensors = fetch_client_part(
        link.stub,
        info,
        cfg.cache_dir,
        metadata=link.metadata,
        max_bytes=cfg.max_weights_mb << 20,
        on_progress=on_progress,
    )
    models = build_client_models(info, tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Paired(info, models.tokenizer, models.drafter, nbytes)


def draft_random(cfg: ClientConfig) -> tuple[Any, Callable[[int], Any]]:
    """The random streams the backend's drafter samples with (tether.client.seeds): offline tokens' one, and the
    session's n-th online draft's."""
    if cfg.backend == "onnx":
        return np.random.default_rng(draft_seed(cfg.seed)), lambda n: np.random.default_rng(draft_seed(cfg.seed, n))
    import torch

    return (
        torch.Generator().manual_seed(draft_seed(cfg.seed)),
        lambda n: torch.Generator().manual_seed(draft_seed(cfg.seed, n)),
    )
