"""In-process text generation: `tether-server generate`, speculative with a drafter or plain without.

Contract: `generate_text(GenerateConfig, on_text)` loads a model directory (config.json, model.safetensors,
tokenizer.json) and, unless `drafter` is "none", a drafter directory trained for that exact target (checked by
fingerprint). It decodes through tether.server.engine and calls `on_text` with each newly completed piece of
text as it is produced (UTF-8 safe: a character split across tokens is emitted once whole), and `on_start` once,
when the models are loaded and the prompt accepted, just before decoding (the CLI echoes the prompt there, so a
failure never follows it). Returns a summary dict: text, token_ids, rounds, tau, new_tokens, wall_s, tokens_per_s,
and time to first token two ways: `ttft_s` from the start of decoding (the models ready) and `ttft_from_start_s`
from `started` (a time.perf_counter() reading: the CLI passes its process's start; default: the call), with
`ready_s`, `started` to the models ready. A cuda `device` that this machine lacks, and a model directory that is
missing, empty or incomplete, are a CommandError (tether.shared.cli_support) before anything loads. The sampling
rule is GenerateConfig.controls (min_p, the penalties, logit_bias: tether.shared.logits_processing); the text
ends after any end-of-text id of the model or a `stop_token_ids` id (left out of the text).

    tether-server generate --prompt "def fib(n):" --max-new-tokens 64            # default target + drafter
    tether-server generate --drafter none --prompt "def fib(n):"                 # plain decoding
    tether-server generate --prompt "import" --frequency-penalty 0.5 --logit-bias 13=-100 --stop-token-ids 7
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.server.engine import SpeculativeEngine
from tether.shared.attention import register_backend
from tether.shared.checkpoint import fingerprint
from tether.shared.cli_support import TARGET_FILES, check_model_dir, require_device
from tether.shared.drafter import load_drafter
from tether.shared.logits_processing import SamplingControls
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer


def default_model_dir(name: str = "target") -> Path:
    """deploy/models/NAME of the source checkout (editable install), else of the current directory."""
    beside_source = Path(__file__).resolve().parent.parent / "deploy" / "models" / name
    return beside_source if beside_source.exists() else Path("deploy/models") / name


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

    @property
    def controls(self) -> SamplingControls:
        """The sampling rule (ControlError, naming the control, for a value out of its range)."""
        return SamplingControls(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias)  # fmt: skip


def logit_bias_pair(text: str) -> tuple[int, float]:
    """--logit-bias's ID=BIAS (argparse's type: a ValueError is its usage error)."""
    token, sep, bias = text.partition("=")
    if not sep:
        raise ValueError(f"--logit-bias takes ID=BIAS, got {text!r}")
    return int(token), float(bias)


def pick_device(requested: str) -> str:
    """`requested` when this machine has it (a CommandError otherwise); "" is cuda when present, else cpu."""
    if requested:
        require_device(requested)
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attention_backend(device: str, requested: str = "auto") -> str:
    """The attention backend for a model on `device`: "auto" is the Triton MoDA kernels on CUDA (registered
    here: the server is the only place that imports them) and the PyTorch reference elsewhere. "triton" on the
    CPU runs the kernels in Triton's interpreter (TRITON_INTERPRET=1): slow, for tests."""
    name = ("triton" if device.startswith("cuda") else "reference") if requested == "auto" else requested
    if name == "triton":
        from tether.kernels.moda import moda_backend
        from tether.kernels.moda_prefill import interpreting

        if not device.startswith("cuda") and not interpreting():
            raise ValueError("--attention triton needs a CUDA device (or TRITON_INTERPRET=1, for tests): use "
                             "--attention auto or reference")  # fmt: skip

        register_backend("triton", moda_backend)
    return name


def load(model_dir: str | Path, device: str, dtype: str = "", attention: str = "auto", *,
         fused: bool | None = None) -> tuple[Transformer, Tokenizer]:  # fmt: skip
    """The model and its tokenizer; dtype "" = bfloat16 on CUDA, float32 elsewhere; attention as in
    `attention_backend`; `fused` (default: on the "triton" backend) applies tether.server.fuse's transform (not
    for a tensor-parallel shard, which re-slices each projection itself)."""
    check_model_dir("model", str(model_dir), TARGET_FILES)
    model_dir = Path(model_dir)
    if dtype and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    dtype = DTYPES[dtype] if dtype else torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = Transformer.from_pretrained(model_dir, device=device, dtype=dtype)
    model.backend = attention_backend(device, attention)
    if model.backend == "triton" if fused is None else fused:
        from tether.server.fuse import fuse  # imports the kernels: only where they run

        fuse(model)
    return model, Tokenizer.from_pretrained(model_dir)


def generate_text(cfg: GenerateConfig, on_text: Callable[[str], None] | None = None, *,
                  on_start: Callable[[], None] | None = None, started: float | None = None) -> dict:  # fmt: skip
    started = time.perf_counter() if started is None else started
    controls = cfg.controls  # its ranges checked before anything loads
    device = pick_device(cfg.device)
    model, tok = load(cfg.model, device)
    drafter = None
    if cfg.drafter != "none":
        drafter = load_drafter(cfg.drafter, model, target_fingerprint=fingerprint(cfg.model))
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
    engine = SpeculativeEngine(model, drafter, k=cfg.k)
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
    chunks = engine.generate(prompt_ids, cfg.max_new_tokens, controls=controls, generator=generator,
                             stop_ids=(*tok.eos_ids, *cfg.stop_token_ids))  # fmt: skip
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
        "rounds": engine.stats.rounds,
        "tau": round(engine.stats.tau, 4),
        "drafter": None if drafter is None else f"{drafter.dcfg.kind} (TLI {drafter.dcfg.tli})",
        "wall_s": round(wall, 4),
        "tokens_per_s": round(len(new) / wall, 2) if wall > 0 else None,
        "ready_s": round(t0 - started, 4),
        "ttft_s": None if first is None else round(first - t0, 4),
        "ttft_from_start_s": None if first is None else round(first - started, 4),
    }
