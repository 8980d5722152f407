"""Training the target LLM from scratch: `tether-server train-target`.

Contract: `train_target(TrainConfig)` trains a model of a named preset on a corpus directory built by
tether.server.train.corpus (built on first use when missing), and leaves in `out`:
- config.json, model.safetensors, tokenizer.json: the finished model, loadable by Transformer.from_pretrained;
- checkpoint.pt: model + optimizer + step + loss history (`save_checkpoint`, train-drafter's writer too), rewritten
  every `save_every` steps and when a run stops; a rerun with the same `out` resumes from it (and a larger --steps
  extends a finished run);
- history.json and loss.png: train and held-out loss against tokens seen, and the throughput of every 10 steps
  (tokens/s; on CUDA also the model FLOPs utilisation against the device's bf16 peak);
- summary.json: where the run stands (`finished` is false after a chunk that stopped early).
Held-out loss is measured on fixed windows of the validation split (files never trained on).

Chunks: `--time-limit-s` (or `--chunk-steps`) stops a run early and saves it; rerunning the same command goes on.
A run cut into chunks is the same run as one left alone: step k's batch is drawn from (seed, k) alone, the lr
schedule is a function of the step, the optimizer state is saved whole, and held-out evaluations fall on the same
steps (none is added where a chunk stops). On the CPU the weights come out bit for bit the same
(tests/server/train/test_train_target.py).

    tether-server train-target --preset small --out runs/target --steps 4000 --device cuda
    tether-server train-target --preset medium --out runs/medium --steps 2000 --device cuda --time-limit-s 480
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tether.server.train.attention import BACKEND as FLEX
from tether.server.train.corpus import CorpusManifest, build_corpus, load_tokens
from tether.shared.attention import get_backend
from tether.shared.cli_support import require_device
from tether.shared.config import ModelConfig, preset
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

_clock = time.perf_counter  # the time limit's and the throughput's clock (a test fakes it)


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "small"  # ModelConfig preset name (tether.shared.config.PRESETS)
    out: str = "runs/target"  # output directory: model files, checkpoint.pt, history.json, loss.png
    data: str = "data/corpus"  # corpus directory (train.bin, val.bin, tokenizer.json); built when missing
    steps: int = 2000  # optimizer steps in total (a resumed run continues up to this count)
    batch_size: int = 32  # sequences per step
    seq_len: int = 256  # tokens per sequence
    lr: float = 3e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # cosine decay floor as a fraction of lr
    warmup: int = 100  # linear warm-up steps
    weight_decay: float = 0.1  # on matrices only; norms, biases and embeddings are not decayed
    grad_clip: float = 1.0  # global grad-norm clip
    eval_every: int = 100  # steps between held-out evaluations
    eval_windows: int = 64  # held-out windows per evaluation (fixed across the run)
    save_every: int = 500  # steps between checkpoint.pt rewrites
    device: str = "cpu"  # "cpu" or "cuda"
    seed: int = 0  # initialisation and batch sampling
    time_limit_s: float = 0.0  # stop early (and save) after this much training time; 0 = no limit
    chunk_steps: int = 0  # stop early (and save) after this many steps in this invocation; 0 = no limit
    attention: str = "auto"  # training attention backend; auto = "flex" on CUDA (no T x T scores), else "reference"
    compile: bool = False  # torch.compile the training forward (pays where eager is launch-bound: small models)
    peak_tflops: float = 0.0  # the device's dense bf16 peak for MFU; 0 = known from its name (H100/H200: 989)
    save_dtype: str = "bfloat16"  # dtype of model.safetensors ("float32" keeps full precision)
    vocab_size: int = 0  # tokenizer vocabulary when the corpus is built here; 0 = the preset's
    max_files: int = 0  # corpus files when built here; 0 = all (tests use a few)
    extra_files: tuple[str, ...] = ()  # user files added to the corpus when it is built here
    overrides: tuple[tuple[str, object], ...] = ()  # ModelConfig fields replaced on top of the preset
    quiet: bool = False  # no progress bar (tests)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def ensure_corpus(cfg: TrainConfig, vocab_size: int) -> Path:
    data = Path(cfg.data)
    if not (data / "manifest.json").exists():
        build_corpus(
            data,
            extra_files=cfg.extra_files,
            vocab_size=vocab_size,
            max_files=cfg.max_files or None,
        )
    return data


class Batches:
    """Random training windows and fixed held-out windows from the flat token files."""

    def __init__(self, data: Path, seq_len: int, seed: int, eval_windows: int):
        self.train = load_tokens(data, "train")
        self.val = load_tokens(data, "val")
        self.seq_len = seq_len
        self.seed = seed
        span = len(self.val) - seq_len - 1
        if span <= 0 or len(self.train) <= seq_len + 1:
            raise ValueError(f"corpus in {data} is too small for seq_len={seq_len}")
        self.val_starts = np.linspace(0, span, num=eval_windows).astype(np.int64)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        w = np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        w = torch.from_numpy(w).to(device, non_blocking=True)
        return w[:, :-1], w[:, 1:]

    def train_batch(self, batch_size: int, device: str, step: int):
        """Step `step`'s batch of random windows, drawn from (seed, step) alone, whatever came before (so a resumed
        run draws what an uninterrupted one would)."""
        starts = np.random.default_rng((self.seed, step)).integers(
            0, len(self.train) - self.seq_len - 1, size=batch_size
        )
        return self._windows(self.train, starts, device)

    def val_batches(self, batch_size: int, device: str):
        for i in range(0, len(self.val_starts), batch_size):
            yield self._windows(self.val, self.val_starts[i : i + batch_size], device)


def attention_backend(cfg: TrainConfig) -> str:
    """The registered attention backend the training forward uses (auto: the fused one on CUDA)."""
    name = cfg.attention
    if name == "auto":
        name = FLEX if cfg.device.startswith("cuda") else "reference"
    get_backend(name)  # an unknown name fails here, listing the registered ones
    return name


# Dense bf16 peaks (TFLOP/s) of the accelerators we train on, by a substring of torch's device name.
PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0))


def peak_flops(cfg: TrainConfig) -> float | None:
    """FLOP/s the device peaks at in bf16, or None where unknown (the CPU; a GPU not in PEAK_TFLOPS)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if not cfg.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(cfg.device))
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS if key in name), None)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward = 3x forward): 2 per weight of every matrix it
    multiplies (the tied LM head included, the embedding lookup not), plus causal attention over the (T + 1) / 2
    positions a token sees on average and its own depth entries, for QK and PV. Recomputation is not counted."""
    d, hd = cfg.dim, cfg.head_dim
    matrices = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.ffn_dim
    matrices += d * 2 * cfg.n_kv_heads * hd if cfg.moda_ffn_kv else 0
    matrices = cfg.n_layers * matrices + cfg.vocab_size * d
    keys = cfg.n_layers * (seq_len + 1) / 2 + sum(cfg.depth_len(i) for i in range(cfg.n_layers))
    return 3 * (2 * matrices + 4 * cfg.n_heads * hd * keys)


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def heldout_loss(model: Transformer, batches: Batches, cfg: TrainConfig) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in batches.val_batches(cfg.batch_size, cfg.device):
        with autocast(cfg.device):
            logits = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def make_optimizer(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    fused = cfg.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def progress_bar(label: str, console: Console, quiet: bool) -> Progress:
    """The training progress bar: steps done, a live info field (loss, held-out figures), time left."""
    columns = [
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    return Progress(*columns, console=console, disable=quiet)


def save_plot(history: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if history["train"]:
        t, loss = zip(*history["train"], strict=True)
        ax.plot(np.array(t) / 1e6, loss, label="train", alpha=0.6)
    if history["val"]:
        t, loss = zip(*history["val"], strict=True)
        ax.plot(np.array(t) / 1e6, loss, label="held-out", marker="o", markersize=3)
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_checkpoint(
    out: Path, weights: dict, optimizer: torch.optim.Optimizer, step: int, history: dict, cfg: Any, title: str
) -> None:
    """A run's resumable state in out/checkpoint.pt (`weights`: the model's state and config under the run's own
    keys, beside the optimizer, step, history and the run's config), written whole or not at all, then its loss
    plot and history.json: what train-target and train-drafter write every checkpoint interval."""
    state = {
        **weights,
        "optimizer": optimizer.state_dict(),
        "step": step,
        "history": history,
        "train_config": dataclasses.asdict(cfg),
    }
    torch.save(state, out / "checkpoint.tmp")
    (out / "checkpoint.tmp").replace(out / "checkpoint.pt")
    save_plot(history, out / "loss.png", title)
    (out / "history.json").write_text(json.dumps(history))


def train_target(cfg: TrainConfig, console: Console | None = None) -> dict:
    """Train (or resume) and return a summary: steps, tokens, held-out loss, throughput, wall time."""
    require_device(cfg.device)  # before the corpus is built: minutes on a small machine
    console = console or Console(stderr=True, quiet=cfg.quiet)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model_cfg: ModelConfig = dataclasses.replace(preset(cfg.preset), **dict(cfg.overrides))
    data = ensure_corpus(cfg, cfg.vocab_size or model_cfg.vocab_size)
    tokenizer = Tokenizer.from_pretrained(data)
    manifest = CorpusManifest.load(data)
    model_cfg = dataclasses.replace(
        model_cfg, vocab_size=tokenizer.vocab_size, max_seq_len=max(model_cfg.max_seq_len, cfg.seq_len)
    )
    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg, backend=attention_backend(cfg)).to(cfg.device)
    optimizer = make_optimizer(model, cfg)
    history: dict = {"train": [], "val": [], "speed": [], "wall_s": 0.0}
    step = 0
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=cfg.device, weights_only=False)
        if ModelConfig.from_dict(ckpt["model_config"]) != model_cfg:
            raise ValueError(f"{ckpt_path} holds a different model config; use a new --out")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, history = ckpt["step"], ckpt["history"]
        history.setdefault("speed", [])  # checkpoints from before throughput was recorded
        console.print(f"resuming {out} at step {step}")
    batches = Batches(data, cfg.seq_len, cfg.seed, cfg.eval_windows)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    token_flops, peak = flops_per_token(model_cfg, cfg.seq_len), peak_flops(cfg)
    console.print(
        f"model {cfg.preset}: {model_cfg.num_params() / 1e6:.2f}M params, moda={model_cfg.moda}, "
        f"norm={model_cfg.norm_position}, attention {model.backend}{', compiled' if cfg.compile else ''}, "
        f"{token_flops / 1e9:.2f} GFLOP/token; corpus {len(batches.train) / 1e6:.2f}M train / "
        f"{len(batches.val) / 1e6:.2f}M held-out tokens ({manifest.python_version})"
    )
    forward = torch.compile(model) if cfg.compile else model  # shares the weights; checkpoints save `model`

    def checkpoint() -> None:
        weights = {"model": model.state_dict(), "model_config": model_cfg.to_dict()}
        title = f"{cfg.preset} (moda={model_cfg.moda}, {model_cfg.norm_position}-norm)"
        save_checkpoint(out, weights, optimizer, step, history, cfg, title)

    if not history["val"]:
        history["val"].append((0, heldout_loss(model, batches, cfg)))
    if cfg.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(cfg.device)
    model.train()
    t0 = _clock() - history["wall_s"]
    start_wall = _clock()
    run_steps, run_train_s = 0, 0.0  # this invocation's steps, and their time less evaluations and saves
    window = (_clock(), step)  # throughput is measured over the steps since this (time, step)
    loss = None
    stop = ""

    def close_window(progress: Progress, task) -> None:
        """Record the throughput of the steps since the window opened (reading the loss syncs the device)."""
        nonlocal run_train_s
        loss_now = loss.item()
        dt, n = _clock() - window[0], step - window[1]
        run_train_s += dt
        rate = n * tokens_per_step / max(dt, 1e-9)
        mfu = rate * token_flops / peak if peak else None
        history["speed"].append((step, rate, mfu))
        info = f"loss {loss_now:.3f} held-out {history['val'][-1][1]:.3f} {rate / 1e3:,.1f}k tok/s"
        progress.update(task, completed=step, info=info + (f" MFU {mfu:.0%}" if mfu else ""))

    with progress_bar("train", console, cfg.quiet) as progress:
        task = progress.add_task("train", total=cfg.steps, completed=step, info="")
        while step < cfg.steps:
            if cfg.chunk_steps and run_steps >= cfg.chunk_steps:
                stop = f"chunk of {cfg.chunk_steps} steps done"
            elif cfg.time_limit_s and _clock() - start_wall > cfg.time_limit_s:
                stop = f"time limit {cfg.time_limit_s:.0f}s reached"
            if stop:
                console.print(f"{stop} at step {step} of {cfg.steps}; rerun the same command to go on")
                break
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, cfg)
            x, y = batches.train_batch(cfg.batch_size, cfg.device, step=step)
            with autocast(cfg.device):
                logits = forward(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            step += 1
            run_steps += 1
            log = step % 10 == 0 or step == cfg.steps
            evaluate = step % cfg.eval_every == 0 or step == cfg.steps
            save = step % cfg.save_every == 0
            if log or evaluate or save:
                close_window(progress, task)
                if log:
                    history["train"].append((step * tokens_per_step, loss.item()))
                if evaluate:
                    history["val"].append((step * tokens_per_step, heldout_loss(model, batches, cfg)))
                history["wall_s"] = _clock() - t0
                if save:
                    checkpoint()
                window = (_clock(), step)
    if loss is not None and step > window[1]:
        close_window(progress, task)
    history["wall_s"] = _clock() - t0
    checkpoint()
    save_dtype = getattr(torch, cfg.save_dtype)
    model.save_pretrained(out, dtype=save_dtype)
    tokenizer.save_pretrained(out)
    run_tokens = run_steps * tokens_per_step
    summary = {
        "preset": cfg.preset,
        "moda": model_cfg.moda,
        "norm_position": model_cfg.norm_position,
        "params": model_cfg.num_params(),
        "steps": step,
        "steps_target": cfg.steps,
        "finished": step >= cfg.steps,
        "tokens": step * tokens_per_step,
        "tokens_per_step": tokens_per_step,
        "heldout_loss_initial": history["val"][0][1],
        "heldout_loss": history["val"][-1][1],
        "heldout_loss_tokens": history["val"][-1][0],  # where the last evaluation fell (a chunk adds none)
        "attention": model.backend,
        "compile": cfg.compile,
        "run_steps": run_steps,  # this invocation's
        "tokens_per_s": round(run_tokens / run_train_s) if run_train_s else None,  # evaluations and saves left out
        "mfu": round(run_tokens / run_train_s * token_flops / peak, 4) if run_train_s and peak else None,
        "flops_per_token": token_flops,
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated(cfg.device) / 2**30, 2) if cfg.device.startswith("cuda") else None
        ),
        "wall_s": round(history["wall_s"], 1),
        "device": cfg.device,
        "corpus_python": manifest.python_version,
        "torch": torch.__version__,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(
        f"{'done' if summary['finished'] else 'stopped'}: step {step}, held-out loss "
        f"{summary['heldout_loss']:.4f} ({summary['wall_s']:.0f}s)"
    )
    return summary
