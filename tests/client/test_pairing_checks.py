"""What the client checks of the server's model description before it touches the disk or allocates.

File names in the weight cache come from the manifest's sha256 fields: anything but 64 lowercase hex digits is
refused before a file is opened (a server once could make the client write its bytes anywhere). Model info and
the manifest must agree with each other and stay within the client's bounds.
"""

import dataclasses
import hashlib
import json
import math

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.errors import Problem, ServerDataError
from tether.client.pairing_checks import check_manifest, check_model_info, expected_client_part
from tether.client.weight_cache import WeightCache, WeightCacheError
from tether.shared.weights import TOKENIZER_TENSOR, TensorEntry, build_manifest, client_part_tensors
from tether.v1 import tether_pb2 as pb


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target()
    drafter = tiny_moa_drafter(target)
    weights = {k: v.to(torch.bfloat16) for k, v in client_part_tensors(target, drafter).items()}
    weights[TOKENIZER_TENSOR] = torch.frombuffer(bytearray(b'{"model": {}}'), dtype=torch.uint8)
    info = pb.ModelInfo(model_config_json=json.dumps(target.cfg.to_dict()), model_fingerprint="f" * 64,
                        drafter_config_json=json.dumps(drafter.dcfg.to_dict()), drafter_fingerprint="d" * 64,
                        tokenizer_sha256="e" * 64, tli_layers=drafter.dcfg.tli)  # fmt: skip
    return info, build_manifest(weights), target.cfg, drafter.dcfg


@pytest.mark.parametrize("key", ["../../escaped", "/tmp/escaped", "a" * 63, "A" * 64, "a" * 64 + "/", "", "a" * 65])
def test_a_cache_key_that_is_not_64_hex_digits_touches_no_file(tmp_path, key):
    cache = WeightCache(tmp_path / "cache")
    entry = TensorEntry("t", "uint8", (4,), 4, key)
    before = sorted(tmp_path.rglob("*"))
    for call in (lambda: cache.write(entry, 0, b"abcd"), lambda: cache.has(entry), lambda: cache.resume_point([entry])):
        with pytest.raises(WeightCacheError) as e:
            call()
        assert e.value.problem == Problem.CACHE_KEY
    assert sorted(tmp_path.rglob("*")) == before
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()


def test_a_well_formed_key_stores_inside_the_cache(tmp_path):
    data = b"abcd"
    entry = TensorEntry("t", "uint8", (4,), 4, hashlib.sha256(data).hexdigest())
    cache = WeightCache(tmp_path)
    cache.write(entry, 0, data)
    assert [p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*.bin")] == ["blobs"]
    assert bytes(cache.load([entry])["t"].numpy()) == data


def test_the_honest_manifest_passes_and_matches_the_configs(tiny):
    info, manifest, cfg, dcfg = tiny
    assert check_model_info(info) == (cfg, dcfg)
    check_manifest(manifest, cfg, dcfg, max_bytes=1 << 30)
    expected = expected_client_part(cfg, dcfg)
    assert {e.name for e in manifest} == set(expected) | {TOKENIZER_TENSOR}
    assert all(expected[e.name][0] == e.shape for e in manifest if e.name in expected)


def lies(manifest: list[TensorEntry]) -> dict[str, tuple[list[TensorEntry], Problem]]:
    first, rest = manifest[0], manifest[1:]

    def with_first(**changes):
        return [dataclasses.replace(first, **changes), *rest]

    tok = next(e for e in manifest if e.name == TOKENIZER_TENSOR)
    big_tok = dataclasses.replace(tok, shape=(64 << 20,), nbytes=64 << 20)
    return {
        "nbytes_vs_shape": (with_first(nbytes=first.nbytes + 2), Problem.MANIFEST),
        "shape_vs_config": (with_first(shape=(1, math.prod(first.shape)), nbytes=first.nbytes), Problem.MANIFEST),
        "one_gib": (with_first(shape=(1 << 19, 1 << 10), nbytes=1 << 30), Problem.MANIFEST),
        "int_dtype": (with_first(dtype="int16"), Problem.MANIFEST),
        "unknown_dtype": (with_first(dtype="complex64"), Problem.MANIFEST),
        "duplicate": ([first, *manifest], Problem.MANIFEST),
        "missing": (rest, Problem.MANIFEST),
        "extra": ([*manifest, dataclasses.replace(first, name="target.model.extra")], Problem.MANIFEST),
        "tokenizer_64mb": ([e if e is not tok else big_tok for e in manifest], Problem.MANIFEST),
        "bad_key": (with_first(sha256="../x"), Problem.CACHE_KEY),
    }


@pytest.mark.parametrize("case", ["nbytes_vs_shape", "shape_vs_config", "one_gib", "int_dtype", "unknown_dtype",
                                  "duplicate", "missing", "extra", "tokenizer_64mb", "bad_key"])  # fmt: skip
def test_a_manifest_that_lies_is_refused(tiny, case):
    _, manifest, cfg, dcfg = tiny
    entries, problem = lies(manifest)[case]
    with pytest.raises(ServerDataError) as e:
        check_manifest(entries, cfg, dcfg, max_bytes=1 << 30)
    assert e.value.problem == problem


def test_the_total_is_capped(tiny):
    _, manifest, cfg, dcfg = tiny
    total = sum(e.nbytes for e in manifest)
    check_manifest(manifest, cfg, dcfg, max_bytes=total)
    with pytest.raises(ServerDataError) as e:
        check_manifest(manifest, cfg, dcfg, max_bytes=total - 1)
    assert e.value.problem == Problem.WEIGHT_SIZE


def info_with(info: pb.ModelInfo, model=None, drafter=None, **fields) -> pb.ModelInfo:
    out = pb.ModelInfo()
    out.CopyFrom(info)
    if model is not None:
        out.model_config_json = (
            model if isinstance(model, str) else json.dumps(json.loads(info.model_config_json) | model)
        )
    if drafter is not None:
        out.drafter_config_json = json.dumps(json.loads(info.drafter_config_json) | drafter)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"model": {"n_layers": 10**9}}, Problem.MODEL_INFO),
        ({"model": {"vocab_size": 0}}, Problem.MODEL_INFO),
        ({"model": {"dim": True}}, Problem.MODEL_INFO),
        ({"model": {"dim": 48.0}}, Problem.MODEL_INFO),
        ({"model": {"moda": 1}}, Problem.MODEL_INFO),
        ({"model": {"norm_eps": float("nan")}}, Problem.MODEL_INFO),
        ({"model": {"rope_scaling": [1, 2]}}, Problem.MODEL_INFO),
        ({"model": {"unknown": 1}}, Problem.MODEL_INFO),
        ({"model": {"n_heads": 5}}, Problem.MODEL_INFO),  # not a multiple of n_kv_heads
        ({"model": "[]"}, Problem.MODEL_INFO),
        ({"model": "{" * 10}, Problem.MODEL_INFO),
        ({"model": json.dumps({"pad": " " * (1 << 17)})}, Problem.MODEL_INFO),
        ({"drafter": {"tli": 4}}, Problem.MODEL_INFO),  # deeper than the 3-layer target
        ({"drafter": {"kind": "magic"}}, Problem.MODEL_INFO),
        ({"drafter": {"lsa_heads": 7}}, Problem.MODEL_INFO),  # LSA width 48 is not a multiple of 7
        ({"tli_layers": 2}, Problem.MODEL_INFO),
        ({"drafter_fingerprint": "../x"}, Problem.CACHE_KEY),
        ({"tokenizer_sha256": "E" * 64}, Problem.CACHE_KEY),
        ({"model_fingerprint": ""}, Problem.MODEL_INFO),
    ],
)
def test_model_info_out_of_bounds_is_refused(tiny, edit, problem):
    info, manifest, cfg, dcfg = tiny
    with pytest.raises(ServerDataError) as e:
        bad = info_with(info, **edit)
        c, d = check_model_info(bad)
        expected_client_part(c, d)  # some contradictions show only when the model is built (on meta)
    assert e.value.problem == problem


def test_the_tokenizer_ends_where_the_server_says():
    """ModelInfo.eos_id (a model whose end-of-text is not `<|endoftext|>`, Llama 3's `<|end_of_text|>`) is the
    fetched tokenizer's eos; unset (an older server) the tokenizer's own; outside the vocabulary refused."""
    from tether.client.pairing_checks import PairingError, check_tokenizer
    from tether.shared.tokenizer import Tokenizer

    tok = Tokenizer.train(texts=["def f(x):\n    return x + 1\n"] * 4, vocab_size=300)
    data = tok.to_json().encode()
    older = pb.ModelInfo(tokenizer_sha256=tok.sha256)
    assert check_tokenizer(data, older).eos_id == tok.eos_id == 0
    assert check_tokenizer(data, pb.ModelInfo(tokenizer_sha256=tok.sha256, eos_id=7)).eos_id == 7
    with pytest.raises(PairingError) as e:
        check_tokenizer(data, pb.ModelInfo(tokenizer_sha256=tok.sha256, eos_id=tok.vocab_size))
    assert e.value.problem == Problem.TOKENIZER


def test_end_of_text_ids_outside_the_vocabulary_or_too_many_are_refused_before_a_download(tiny):
    from tether.client.pairing_checks import MAX_EOS_IDS

    info, _, cfg, _ = tiny
    for ids, field in (([1, cfg.vocab_size], "eos_ids"), (range(MAX_EOS_IDS + 1), "eos_ids"), (cfg.vocab_size, "")):
        bad = info_with(info)
        if field:
            bad.eos_ids.extend(ids)
        else:
            bad.eos_id = ids
        with pytest.raises(ServerDataError) as e:
            check_model_info(bad)
        assert e.value.problem == Problem.MODEL_INFO
    ok = info_with(info, eos_id=1)
    ok.eos_ids.extend([1, 2])
    check_model_info(ok)
