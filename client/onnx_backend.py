"""The onnxruntime drafting backend for the edge client: export the paired drafter once, then draft with it.

Contract: `onnx_drafter_for(models, cache_dir)` returns an OnnxDrafter (tether.client.onnx_drafter) for the
drafter that pairing built, exporting its client part (tether.server.onnx_export) into
`cache_dir/onnx/<drafter fingerprint>` the first time and reusing that export afterwards. The drafter it returns
has the torch drafter's begin/commit/draft interface and gives the same greedy drafts.
This is the local export, which needs torch (and tether.server) on the client; the torch-free path has the server
export the part (tether.client.onnx_pairing.fetch_onnx_part).

    drafter = onnx_drafter_for(build_client_models(info, tensors), "~/.cache/tether")
"""

from __future__ import annotations

from pathlib import Path

from tether.client.errors import Problem, ServerDataError
from tether.client.onnx_drafter import MANIFEST, OnnxDrafter
from tether.client.pairing import ClientModels
from tether.client.weight_cache import is_sha256


def onnx_drafter_for(models: ClientModels, cache_dir: str | Path) -> OnnxDrafter:
    fp = models.info.drafter_fingerprint
    if not is_sha256(fp):  # pairing checked it already; a directory name from the server gets a second look
        raise ServerDataError(Problem.CACHE_KEY, f"drafter fingerprint {fp[:80]!r} is not 64 lowercase hex digits")
    out = Path(cache_dir).expanduser() / "onnx" / fp
    if not (out / MANIFEST).exists():
        from tether.server.onnx_export import export_client_onnx

        tmp = out.with_name(out.name + ".partial")
        export_client_onnx(models.drafter, tmp)
        tmp.replace(out)  # a complete export or none: an interrupted one is redone
    return OnnxDrafter.load(out)
