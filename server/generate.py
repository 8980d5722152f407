"""In-process text generation: `tether-server generate`, speculative with a drafter or plain without.

Contract: `generate_text(GenerateConfig, on_text)` loads a model directory (config.json, model.safetensors,
tokenizer.json) and, unless `drafter` is "none", a drafter directory trained for that exact target (checked by
fingerprint), as the engine serve builds (tether.server.engine_core: its kernels warmed up into `cache_dir`, its paged
pool, its step graphs, whose shapes are recorded there too, so a second run captures them before it decodes). It
decodes through tether.server.engine over that pool and calls `on_text` with each newly completed piece of text as it
is produced (UTF-8 safe: a character split across tokens is emitted once whole), and
`on_start` once, when the models are loaded and the prompt accepted, just before decoding (the CLI echoes the prompt
there, so a failure never follows it). Returns a summary dict: text, token_ids, rounds, tau, new_tokens, wall_s,
tokens_per_s, and time to first token two ways: `ttft_s` from the start of decoding (the models ready) and
`ttft_from_start_s` from `started` (a time.perf_counter() reading: the CLI passes its process's start; default: the
call), with `ready_s`, `started` to the models ready. A cuda `device` that this machine lacks, and a model directory
that is missing, empty or incomplete, are a CommandError (tether.shared.cli_support) before anything loads. The sampling
rule is GenerateConfig.controls (min_p, the penalties, logit_bias: tether.shared.logits_processing); the text ends after
any end-of-text id of the model or a `stop_token_ids` id (left out of the text).

    tether-server generate --prompt "def fib(n):" --max-new-tokens 64            # default target + drafter
    tether-server generate --drafter none --prompt "def fib(n):"                 # plain decoding
    tether-server generate --prompt "import" --frequency-penalty 0.5 --logit-bias 13=-100 --stop-token-ids 7
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tether.server.engine import SpeculativeEngine
from tether.server.engine_core import Engine
from tether.server.model_loading import default_model_dir, pick_device
from tether.server.serve_config import ServeConfig
from tether.shared.logits_processing import SamplingControls


@dataclass(frozen=True)
class GenerateConfig:
    model: str = str(default_model_dir())  # model directory (ours, a Hugging Face Llama/Qwen2 one) or a cached hub id
    revision: str = ""  # the hub revision (branch, tag or commit) when --model is a hub id; empty: main
    drafter: str = str(default_model_dir("drafter"))  # drafter directory, or "none" for plain decoding
    k: int = 5  # draft tokens per verification round
    prompt: str = ""  # text to continue
    max_new_tokens: int = 128  # upper bound on generated tokens (stops early at end-of-text)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = 0  # sample among the k most probable tokens only (0: no limit)
    seed: int = 0  # sampling seed
    device: str = ""  # "cpu" / "cuda"; empty = cuda when present
    min_p: float = 0.0  # drop tokens below min_p x the most probable one's probability (0: off)
    presence_penalty: float = 0.0  # in [-2, 2], over the generated tokens
    frequency_penalty: float = 0.0  # in [-2, 2], over the generated tokens
    repetition_penalty: float = 1.0  # > 0, over prompt and generated tokens (1: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # ID=BIAS pairs, each bias in [-100, 100]
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the text besides the model's end-of-text ids
    # A second run on a GPU then compiles nothing: the kernels, their tuning and the step graphs' shapes are kept.
    cache_dir: str = ""  # compiled kernels kept across runs, as serve's --cache-dir (empty: Triton's own cache)
    kv_pool_mb: int = 256  # memory of the KV pool the generation's sequence lives in (as serve's --kv-pool-mb)

    @property
    def controls(self) -> SamplingControls:
        """The sampling rule (ControlError, naming the control, for a value out of its range)."""
        return SamplingControls.of(self)


def logit_bias_pair(text: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS (argparse's type: a ValueError is its usage error)."""
    token, sep, bias = text.partition("=")
    if not sep:
        raise ValueError(f"--logit-bias takes ID=BIAS, got {text!r}")
    return int(token), float(bias)


def generate_text(
    cfg: GenerateConfig,
    on_text: Callable[[str], None] | None = None,
    *,
    on_start: Callable[[], None] | None = None,
    started: float | None = None,
) -> dict:
    started = time.perf_counter() if started is None else started
    controls = cfg.controls  # its ranges checked before anything loads
    # The engine serve builds, warmed up the same way (kernels compiled and tuned once into the cache, then read
    # from it): one generation is a session of it.
    serve_cfg = ServeConfig(
        model=cfg.model,
        revision=cfg.revision,
        drafter=cfg.drafter,
        device=pick_device(cfg.device),
        cache_dir=cfg.cache_dir,
        kv_pool_mb=cfg.kv_pool_mb,
        round_graph_tokens=0,
        max_sessions=1,
    )
    engine = Engine.build(serve_cfg)
    try:
        engine.warm_up()
        result = _generate(cfg, engine, controls, on_text, on_start, started)
        # As serve does when it stops: the next run's warm-up captures this run's step graphs (decode chains and
        # verify rounds at each table width) before it decodes, where this run captured each on first use.
        engine.record_shapes()
        return result
    finally:
        engine.close()


def _generate(
    cfg: GenerateConfig,
    engine: Engine,
    controls: SamplingControls,
    on_text: Callable[[str], None] | None,
    on_start: Callable[[], None] | None,
    started: float,
) -> dict:
    model, tok, drafter = engine.target, engine.tokenizer, engine.drafter
    prompt_ids = tok.encode(cfg.prompt)
    if not prompt_ids:
        prompt_ids = [tok.eos_id]  # an empty prompt starts a fresh document
    if len(prompt_ids) + cfg.max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) exceeds the model's "
            f"max_seq_len {model.cfg.max_seq_len}"
        )
    controls.check_vocab(model.cfg.vocab_size)
    generator = torch.Generator().manual_seed(cfg.seed)
    text_stream = tok.detokenizer(context=prompt_ids)  # the continuation reads as it does after the prompt
    spec = SpeculativeEngine(model, drafter, k=cfg.k, pool=engine.pool)
    new: list[int] = []
    pieces: list[str] = []

    def emit(piece: str) -> None:
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)

    if on_start:
        on_start()
    t0 = time.perf_counter()
    first = None  # when the first token came
    chunks = spec.generate(
        prompt_ids,
        cfg.max_new_tokens,
        controls=controls,
        generator=generator,
        stop_ids=(*tok.eos_ids, *cfg.stop_token_ids),
    )
    for chunk in chunks:
        if first is None and chunk:
            first = time.perf_counter()
        new += chunk
        emit(text_stream.push(t for t in chunk if t not in tok.eos_ids and t not in cfg.stop_token_ids))
    emit(text_stream.flush())
    wall = time.perf_counter() - t0
    return {
        "text": "".join(pieces),
        "token_ids": new,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(new),
        "rounds": spec.stats.rounds,
        "tau": round(spec.stats.tau, 4),
        "drafter": None if drafter is None else f"{drafter.dcfg.kind} (TLI {drafter.dcfg.tli})",
        "wall_s": round(wall, 4),
        "tokens_per_s": round(len(new) / wall, 2) if wall > 0 else None,
        "ready_s": round(t0 - started, 4),
        "ttft_s": None if first is None else round(first - t0, 4),
        "ttft_from_start_s": None if first is None else round(first - started, 4),
    }
