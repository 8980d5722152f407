"""The engine (tether.server.engine_core): what `Engine.build` makes of a ServeConfig, and the state it alone owns."""

import asyncio
import logging

import pytest
import torch
from toy_models import toy_model_dir

from tether.server.engine_core import Engine
from tether.server.kv_pool import KVPool
from tether.server.serve_config import ServeConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.v1 import tether_pb2 as pb


@pytest.fixture(scope="module")
def engine():
    built = Engine.build(ServeConfig(model=str(toy_model_dir()), drafter=str(toy_model_dir("drafter")),
                                     device="cpu", max_sessions=3))  # fmt: skip
    yield built
    built.close()


def test_build_loads_the_configured_models_and_owns_the_serving_state(engine):
    info = engine.model_info
    assert info.model_fingerprint == fingerprint(str(toy_model_dir())) and not info.server_only
    assert info.drafter_fingerprint == engine.drafter_fingerprint and engine.manifest
    assert engine.config.max_sessions == 3 and engine.table.limits.max_sessions == 3
    # --kv-pool-mb 0 (auto) off CUDA is 256 MB, and the pool the table lends from has that size.
    assert engine.config.kv_pool_bytes == 256 << 20
    per_block = KVPool.block_bytes(engine.target.cfg, engine.pool.block_size, engine.pool.k.dtype)
    assert engine.table.pool is engine.pool and engine.pool.num_blocks == (256 << 20) // per_block
    assert engine.warm_up() == "no kernel warm-up"  # the reference backend compiles nothing


def test_the_handlers_and_plain_decoding_go_through_the_one_engine(engine):
    service = TetherService(engine)
    assert service.config is engine.config
    prompt = engine.tokenizer.encode("def f(x):")
    want = engine.target.generate(torch.tensor([prompt]), 6)

    async def decode():
        got = []
        async for chunk in engine.plain.decode(prompt, pb.SamplingParams(), 6):
            got += chunk
        return got

    assert asyncio.run(decode()) == list(want)
    assert engine.pool.used_blocks == 0  # given back when the generation ended


def test_an_explicit_pool_size_and_no_drafter(caplog):
    with caplog.at_level(logging.INFO, logger="tether.server"):
        plain = Engine.build(ServeConfig(model=str(toy_model_dir()), drafter="none", device="cpu", kv_pool_mb=8))
    try:
        assert plain.model_info.server_only and plain.exporter is None and not plain.manifest
        assert plain.config.kv_pool_bytes == 8 << 20
        assert any(r.getMessage().startswith("KV pool 8 MB") for r in caplog.records)
    finally:
        plain.close()
