"""Weight streaming: the client part's manifest, chunks of at most 1 MiB, and a download resumed halfway."""

import hashlib

import pytest
import torch

from tether.client.weight_cache import WeightCache, WeightCacheError
from tether.shared.config import PRESETS
from tether.shared.drafter import DrafterConfig
from tether.shared.drafter_loading import build_drafter
from tether.shared.model import Transformer
from tether.shared.weights import MAX_CHUNK, build_manifest, client_part_tensors, iter_chunks, tensor_bytes


@pytest.fixture(scope="module")
def part():
    torch.manual_seed(0)
    target = Transformer(PRESETS["tiny"]).to(torch.bfloat16)
    drafter = build_drafter(target, DrafterConfig(kind="moa", tli=1, n_heads=4, n_kv_heads=2, head_dim=12))
    tensors = client_part_tensors(target, drafter.to(torch.bfloat16))
    return tensors, build_manifest(tensors)


def test_client_part_holds_what_the_edge_needs(part):
    tensors, manifest = part
    names = set(tensors)
    assert "target.model.embed_tokens.weight" in names and "target.model.norm.weight" in names
    assert any(n.startswith("target.model.layers.2.") for n in names)  # the TLI layer (last of 3)
    assert not any(n.startswith(("target.model.layers.0.", "target.model.layers.1.")) for n in names)
    assert any(n.startswith("drafter.sa.") for n in names) and any(n.startswith("drafter.ca.") for n in names)
    assert not any(n.startswith("drafter.lsa.") for n in names)  # LSA stays on the server
    for e in manifest:
        assert e.sha256 == hashlib.sha256(tensor_bytes(tensors[e.name])).hexdigest()


def test_chunks_are_bounded_and_cover_every_byte(part):
    tensors, manifest = part
    chunks = list(iter_chunks(tensors, manifest, max_chunk=1000))
    assert all(len(d) <= 1000 for _, _, d in chunks)
    joined = {}
    for name, offset, data in chunks:
        assert offset == len(joined.get(name, b""))
        joined[name] = joined.get(name, b"") + data
    assert all(joined[e.name] == tensor_bytes(tensors[e.name]) for e in manifest)
    with pytest.raises(ValueError):
        list(iter_chunks(tensors, manifest, max_chunk=MAX_CHUNK + 1))


def test_download_resumed_halfway_gives_identical_tensors(part, tmp_path):
    tensors, manifest = part
    by_name = {e.name: e for e in manifest}
    cache = WeightCache(tmp_path)
    all_chunks = list(iter_chunks(tensors, manifest, max_chunk=700))
    for name, offset, data in all_chunks[: len(all_chunks) // 2]:  # the link drops halfway
        cache.write(by_name[name], offset, data)
    point = cache.resume_point(manifest)
    assert point is not None and point != (manifest[0].name, 0)
    resumed = WeightCache(tmp_path)  # a new process picks the cache up from disk
    name, offset = resumed.resume_point(manifest)
    again = list(iter_chunks(tensors, manifest, name, offset, max_chunk=700))
    assert len(again) < len(all_chunks)
    for n, o, d in [all_chunks[len(all_chunks) // 2 - 1], *again]:  # one chunk is sent twice: harmless
        resumed.write(by_name[n], o, d)
    assert resumed.resume_point(manifest) is None
    loaded = resumed.load(manifest)
    for e in manifest:
        assert hashlib.sha256(tensor_bytes(loaded[e.name])).hexdigest() == e.sha256
        assert torch.equal(loaded[e.name], tensors[e.name])


def test_corrupt_download_is_refused_and_restarted(part, tmp_path):
    tensors, manifest = part
    entry = manifest[0]
    data = bytearray(tensor_bytes(tensors[entry.name]))
    data[5] ^= 0xFF
    cache = WeightCache(tmp_path)
    with pytest.raises(WeightCacheError, match="sha256"):
        cache.write(entry, 0, bytes(data))
    assert cache.resume_point(manifest) == (entry.name, 0)
    with pytest.raises(WeightCacheError, match="gap"):
        cache.write(entry, 10, b"x")
    with pytest.raises(WeightCacheError, match="not downloaded"):
        cache.load(manifest)
