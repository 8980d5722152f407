"""Training a drafter against a frozen target: `tether-server train-drafter`.

The MoA recipe (REFERENCES.md), scaled to our models:
- the target is frozen and run online on every batch (its K/V of every layer, hidden states and logits);
- loss = 0.1 x soft cross-entropy against the target's softmax + SmoothL1 on features: the drafter's output
  feature against the target's last hidden state; with TLI N > 0, half that and half SmoothL1(CA output,
  the target's hidden state entering its last N layers);
- T-step-bounded verification points: per sequence a block length k ~ U{6..14} and a random phase; position t
  sees target states only before the last verification point <= t, exactly what drafting sees at inference;
- the staircase SA-mask curriculum: with probability max(0, 1 - 2 * progress), SA sees only its own block;
- with `tli_depth` (MoA on a MoDA target), plus the depth predictor's regression (tether.shared.tli_depth) against
  the target's real depth entries of its layers below TLI at every position, from the target's exact hidden
  entering TLI and from the CA output (detached: this term trains the predictor only); the TLI blocks of the
  forward use the predicted entries, so the token loss trains through them too; `depth_only_steps` first trains
  the predictor alone on that regression (a target forward and the MLP: cheap), so the token loss starts from
  useful entries (a drafter without a predictor skips those steps, its batches and schedule left as they are);
- AdamW (0.9, 0.95), no weight decay, grad clip 1.0, linear warm-up then cosine decay.
The EAGLE baseline trains on the same batches and budget with its own objective (teacher-forced features
plus uniform noise, as EAGLE does), so comparisons are like for like.
Held-out evaluation: loss, and the mean acceptance length of greedy chain drafting on held-out prompts.
The corpus must hold the target's token ids: its tokenizer is checked against the target's tokenizer.json (sha256)
before anything loads, so a Hugging Face target needs a corpus built with `build-corpus --tokenizer`.

    tether-server train-drafter --target deploy/models/target --kind moa --tli 1 --out runs/moa1 --device cuda
    tether-server train-drafter --tli 3 --set tli_depth=256 --init deploy/models/drafter --depth-only-steps 400 \\
        --steps 410 --lr 3e-3 --out runs/moa3-depth     # the default drafter plus a depth predictor
    tether-server build-corpus --tokenizer MODEL_DIR --out data/corpus-hf        # a Hugging Face target's ids
    tether-server train-drafter --target MODEL_DIR --data data/corpus-hf --out runs/drafter-hf --device cuda
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console

from tether.server.engine import SpeculativeEngine
from tether.server.model_loading import default_model_dir
from tether.server.train.corpus import CorpusManifest
from tether.server.train.target import Batches, autocast, lr_at, progress_bar, save_checkpoint
from tether.shared.checkpoint import fingerprint
from tether.shared.cli_support import require_device
from tether.shared.drafter import DrafterConfig, load_drafter_config, load_drafter_weights, save_drafter
from tether.shared.drafter_loading import build_drafter
from tether.shared.model import Transformer
from tether.shared.tli_depth import depth_regression
from tether.shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class DrafterTrainConfig:
    target: str = str(default_model_dir())  # target model directory (frozen during training)
    kind: str = "moa"  # "moa" or "eagle"
    tli: int = 1  # MoA's TLI N (ignored for eagle)
    out: str = "runs/drafter"  # output directory: drafter files, checkpoint.pt, history.json, loss.png
    data: str = "data/corpus"  # corpus directory built by `tether-server build-corpus` (same tokenizer)
    steps: int = 2000  # optimizer steps in total (a resumed run continues up to this count)
    batch_size: int = 32  # sequences per step
    seq_len: int = 256  # tokens per sequence
    lr: float = 2e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    warmup: int = 50  # linear warm-up steps (the MoA recipe's 50)
    grad_clip: float = 1.0  # global grad-norm clip
    block_min: int = 6  # smallest verification block length k
    block_max: int = 14  # largest verification block length k
    eagle_noise: float = 0.1  # EAGLE: uniform feature noise half-width, relative to the feature RMS
    eval_every: int = 250  # steps between held-out evaluations
    eval_windows: int = 32  # held-out windows for the loss
    eval_prompts: int = 8  # held-out prompts for the acceptance-length eval
    eval_prompt_len: int = 64  # tokens per eval prompt
    eval_new_tokens: int = 48  # tokens generated per eval prompt
    eval_k: int = 5  # draft tokens per round in the eval
    save_every: int = 500  # steps between checkpoint.pt rewrites
    device: str = "cpu"  # "cpu" or "cuda"
    seed: int = 0  # initialisation and batches
    time_limit_s: float = 0.0  # stop early (and save) after this much training time; 0 = no limit
    save_dtype: str = "bfloat16"  # dtype of drafter.safetensors
    overrides: tuple[tuple[str, object], ...] = ()  # DrafterConfig fields replaced on top of the defaults
    depth_only_steps: int = 0  # with tli_depth: the first steps train the depth predictor alone (regression only)
    init: str = ""  # a drafter directory, same architecture but tli_depth, whose weights start a new run; "" = fresh
    quiet: bool = False  # no progress bar


def verification_boundaries(B: int, T: int, lo: int, hi: int, rng: np.random.Generator) -> torch.Tensor:
    """[B, T] long: the last verification point <= t, per sequence with its own block length and phase."""
    k = rng.integers(lo, hi + 1, size=(B, 1))
    phase = rng.integers(0, k[:, 0], size=B)[:, None]
    t = np.arange(T)[None]
    boundary = ((t + phase) // k) * k - phase
    return torch.from_numpy(np.clip(boundary, 0, None))


def staircase_mask(boundary: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: SA at position t sees only positions in [boundary[t], t] (its own block)."""
    T = boundary.shape[1]
    j = torch.arange(T, device=boundary.device)
    return (j[None, None, :] >= boundary[:, :, None]) & (j[None, None, :] <= j[None, :, None])


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    return -(target_logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1).mean()


def drafter_loss(drafter, tokens: torch.Tensor, target: Transformer, cfg: DrafterTrainConfig, rng, progress: float):
    """One batch's loss, and a dict of its parts for the log."""
    L, N = target.cfg.n_layers, drafter.dcfg.tli
    predictor = drafter.depth_predictor
    with torch.no_grad(), autocast(cfg.device):
        out = target.run(tokens, hidden_layers=(L - N, L), return_kv=True, return_depth=predictor is not None)
    h_in, h_out = out.hidden[0].float(), out.hidden[1].float()
    B, T = tokens.shape
    with autocast(cfg.device):
        if drafter.dcfg.kind == "moa":
            boundary = verification_boundaries(B, T, cfg.block_min, cfg.block_max, rng).to(tokens.device)
            sa_mask = staircase_mask(boundary) if rng.random() < max(0.0, 1 - 2 * progress) else None
            logits, ca_out, feat = drafter.forward_train(tokens, out.k, out.v, boundary, sa_mask)
            if N:
                reg = 0.5 * F.smooth_l1_loss(feat.float(), h_out) + 0.5 * F.smooth_l1_loss(ca_out.float(), h_in)
            else:
                reg = F.smooth_l1_loss(ca_out.float(), h_out)
            if predictor is not None:
                depth = depth_loss(predictor, target, out, tokens, ca_out)
        else:
            scale = h_out.pow(2).mean().sqrt()
            noise = (torch.rand_like(h_out) * 2 - 1) * cfg.eagle_noise * scale
            logits, feat = drafter.forward_train(tokens, h_out + noise)
            reg = F.smooth_l1_loss(feat.float(), h_out)
    ce = soft_ce(logits, out.logits)
    top1 = (logits.argmax(-1) == out.logits.argmax(-1)).float().mean()
    parts = {"ce": ce.item(), "reg": reg.item(), "top1": top1.item()}
    if predictor is None:
        return 0.1 * ce + reg, parts
    return 0.1 * ce + reg + depth, parts | {"depth": depth.item()}


def depth_loss(predictor, target: Transformer, out, tokens, ca_out: torch.Tensor | None = None) -> torch.Tensor:
    """The depth predictor's regression (tether.shared.tli_depth.depth_regression) against the entries the target
    wrote below TLI (`out`: its forward with return_depth, hidden_layers starting with L - N), from its exact hidden
    entering TLI (what the TLI blocks would get from a perfect CA) and, given, from the CA output, which drafting
    feeds them; averaged."""
    E = predictor.n_entries
    true = (out.depth[0][:, :, :E], out.depth[1][:, :, :E])  # [B, T, E, Hkv, D] each
    h = out.hidden[0]
    cos, sin = target.rope(torch.arange(h.shape[1], device=h.device)[None])
    emb = target.embed_tokens(tokens).detach()  # [B, T, dim]
    exact = depth_regression(predictor(h, emb, cos, sin), true)
    if ca_out is None:
        return exact
    return 0.5 * exact + 0.5 * depth_regression(predictor(ca_out.detach(), emb, cos, sin), true)


def depth_only_loss(drafter, tokens: torch.Tensor, target: Transformer, cfg: DrafterTrainConfig):
    """A depth_only_steps batch: the predictor's regression alone, or None for a drafter without a predictor."""
    predictor = drafter.depth_predictor
    if predictor is None:
        return None, {}
    with torch.no_grad(), autocast(cfg.device):
        out = target.run(tokens, hidden_layers=(target.cfg.n_layers - drafter.dcfg.tli,), return_depth=True)
    with autocast(cfg.device):
        loss = depth_loss(predictor, target, out, tokens)
    return loss, {"depth": loss.item()}


def init_from(drafter, path: str | Path) -> None:
    """Start `drafter` from the weights of the drafter directory `path`: same architecture, except that `path` may
    lack the depth predictor (which then starts fresh)."""
    have = load_drafter_config(path).to_dict()
    want = drafter.dcfg.to_dict()
    differ = sorted(
        k for k in (have.keys() | want.keys()) - {"tli_depth", "target_fingerprint"} if have.get(k) != want.get(k)
    )
    if differ or have["target_fingerprint"] != want["target_fingerprint"]:
        raise ValueError(f"--init {path} is another drafter (differs in {differ or ['target_fingerprint']})")
    result = drafter.load_state_dict({k: v.float() for k, v in load_drafter_weights(path).items()}, strict=False)
    fresh = [k for k in result.missing_keys if not k.startswith("depth_predictor.")]
    if fresh or result.unexpected_keys:
        raise ValueError(
            f"--init {path}: weights do not fit (missing {fresh[:3]}, unexpected {result.unexpected_keys[:3]})"
        )


@torch.no_grad()
def heldout_eval(drafter, target: Transformer, batches: Batches, cfg: DrafterTrainConfig) -> dict:
    """Held-out loss parts and the greedy chain acceptance length on held-out prompts."""
    drafter.eval()
    rng = np.random.default_rng(1234)
    parts = []
    for x, _ in batches.val_batches(cfg.batch_size, cfg.device):
        parts.append(drafter_loss(drafter, x, target, cfg, rng, progress=1.0)[1])
    result = {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}  # with "depth" when it is trained
    result["tau"] = acceptance_length(drafter, target, batches.val, cfg)
    drafter.train()
    return result


def acceptance_length(drafter, target: Transformer, val: np.ndarray, cfg: DrafterTrainConfig) -> float:
    """Greedy chain drafting on held-out prompts, with the drafter cast to the target's dtype as deployed
    (training keeps fp32 master weights)."""
    deployed = build_drafter(target, drafter.dcfg)
    deployed.load_state_dict(drafter.state_dict())
    deployed = deployed.to(device=target.device, dtype=target.embed_tokens.weight.dtype).eval()
    engine = SpeculativeEngine(target, deployed, k=cfg.eval_k)
    starts = np.linspace(0, len(val) - cfg.eval_prompt_len - 1, cfg.eval_prompts).astype(np.int64)
    taus: list[int] = []
    for s in starts:
        prompt = val[s : s + cfg.eval_prompt_len].astype(np.int64).tolist()
        for _ in engine.generate(prompt, cfg.eval_new_tokens):
            pass
        taus += engine.stats.taus
    return float(np.mean(taus))


def check_corpus_tokenizer(target: str | Path, data: str | Path) -> None:
    """A drafter learns the target's token ids: refuse a corpus tokenized with another tokenizer (say tether's own
    BPE for a Hugging Face target), which would train it on ids that mean other text, or none at all."""
    path = Path(target) / "tokenizer.json"
    if path.is_file() and Tokenizer.from_file(path).sha256 != CorpusManifest.load(data).tokenizer_sha256:
        raise ValueError(
            f"the corpus in {data} was not tokenized with {target}'s tokenizer: build one that is with "
            f"`tether-server build-corpus --tokenizer {target} --out DIR`, then --data DIR"
        )


def train_drafter(cfg: DrafterTrainConfig, console: Console | None = None) -> dict:
    require_device(cfg.device)
    check_corpus_tokenizer(cfg.target, cfg.data)
    console = console or Console(stderr=True, quiet=cfg.quiet)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    target = Transformer.from_pretrained(cfg.target, device=cfg.device, dtype=dtype)
    for p in target.parameters():
        p.requires_grad_(False)
    dcfg = DrafterConfig(
        kind=cfg.kind,
        tli=cfg.tli if cfg.kind == "moa" else 0,
        target_fingerprint=fingerprint(cfg.target),
        **dict(cfg.overrides),
    )
    torch.manual_seed(cfg.seed)
    drafter = build_drafter(target, dcfg).to(cfg.device)  # trainable weights stay fp32 (autocast computes)
    if cfg.init:
        init_from(drafter, cfg.init)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    history: dict = {"train": [], "val": [], "tau": [], "wall_s": 0.0}
    step = 0
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=cfg.device, weights_only=False)
        if ckpt["drafter_config"] != dcfg.to_dict():
            raise ValueError(f"{ckpt_path} holds a different drafter; use a new --out")
        drafter.load_state_dict(ckpt["drafter"])
        opt.load_state_dict(ckpt["optimizer"])
        step, history = ckpt["step"], ckpt["history"]
        console.print(f"resuming {out} at step {step}")
    batches = Batches(Path(cfg.data), cfg.seq_len, cfg.seed, cfg.eval_windows)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    console.print(f"drafter {dcfg.kind} (TLI {dcfg.tli}): {drafter.num_trainable() / 1e6:.2f}M trainable params")

    def evaluate() -> None:
        ev = heldout_eval(drafter, target, batches, cfg)
        history["val"].append((step * tokens_per_step, 0.1 * ev["ce"] + ev["reg"]))
        history["tau"].append((step, ev["tau"], ev["top1"]))
        if "depth" in ev:
            history.setdefault("depth", []).append((step, ev["depth"]))

    def checkpoint() -> None:
        weights = {"drafter": drafter.state_dict(), "drafter_config": dcfg.to_dict()}
        save_checkpoint(out, weights, opt, step, history, cfg, f"drafter {dcfg.kind} (TLI {dcfg.tli})")

    if not history["tau"]:
        evaluate()
    drafter.train()
    t0 = time.perf_counter() - history["wall_s"]
    start_wall = time.perf_counter()
    with progress_bar("draft", console, cfg.quiet) as progress:
        task = progress.add_task("train", total=cfg.steps, completed=step, info="")
        while step < cfg.steps:
            if cfg.time_limit_s and time.perf_counter() - start_wall > cfg.time_limit_s:
                console.print(f"time limit {cfg.time_limit_s:.0f}s reached at step {step}")
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            # Step k's randomness (its batch, verification points, curriculum draw, EAGLE's noise) comes from
            # (seed, k) alone, whatever ran before it (evaluations draw noise too): a resumed run is the run left alone.
            rng = np.random.default_rng((cfg.seed, step, 1))
            torch.manual_seed(int(rng.integers(2**62)))
            x, _ = batches.train_batch(cfg.batch_size, cfg.device, step=step)
            if step < cfg.depth_only_steps:
                loss, parts = depth_only_loss(drafter, x, target, cfg)
            else:
                loss, parts = drafter_loss(drafter, x, target, cfg, rng, progress=step / cfg.steps)
            if loss is not None:
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
                opt.step()
            step += 1
            if step % 10 == 0 and "top1" in parts:
                history["train"].append((step * tokens_per_step, loss.item()))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                evaluate()
            history["wall_s"] = time.perf_counter() - t0
            info = " ".join(f"{k} {v:.3f}" for k, v in parts.items()) + f" tau {history['tau'][-1][1]:.2f}"
            progress.update(task, completed=step, info=info)
            if step % cfg.save_every == 0:
                checkpoint()
    if history["tau"][-1][0] != step:
        evaluate()
    checkpoint()
    save_drafter(drafter, out, dtype=getattr(torch, cfg.save_dtype))
    summary = {
        "kind": dcfg.kind,
        "tli": dcfg.tli,
        "trainable_params": drafter.num_trainable(),
        "steps": step,
        "tokens": step * tokens_per_step,
        "heldout_tau_initial": history["tau"][0][1],
        "heldout_tau": history["tau"][-1][1],
        "heldout_top1": history["tau"][-1][2],
        "heldout_loss": history["val"][-1][1],
        **({"heldout_depth_loss": history["depth"][-1][1]} if "depth" in history else {}),
        "wall_s": round(history["wall_s"], 1),
        "device": cfg.device,
        "torch": torch.__version__,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"done: step {step}, held-out tau {summary['heldout_tau']:.3f} ({summary['wall_s']:.0f}s)")
    return summary
