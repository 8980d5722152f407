"""Draft traces: what the default drafter proposed, round by round, on real prompts (issue [3/7], the request path).

A trace replays real speculation without a drafter in the loop: bench/server.py `--mode trace` sends, for round r
of a session, the drafts recorded for round r, so the server's verdicts (and so tau) are the ones real edge clients
would get, while the synthetic clients stay cheap enough to run by the hundred.

Recording (`record`): the in-process SpeculativeEngine (target + drafter, chains of `k` drafts, greedy, no stop at
end-of-text) generates `tokens` new tokens after each prompt; each prompt is a window of `prompt_len` token ids from
a Python source file of the standard library (`stdlib_prompts`: the top-level modules and a few packages, files
in sorted order, `n` of them evenly spaced over the files long enough, the window in the middle of the file).

File format (JSON, `save` / `load`):

    {"format": "tether-draft-traces", "version": 1,
     "target_fingerprint": "...",              # tether.shared.checkpoint.fingerprint of the target directory
     "drafter": "drafter", "drafter_sha256": "...",   # the drafter directory's name, sha256 of its weights file
     "device": "cpu", "dtype": "float32", "torch": "2.x", "python": "3.11.7",
     "k": 5, "temperature": 0.0, "prompt_len": 256, "tokens": 256,
     "traces": [{"source": "json/decoder.py", "offset": 1681,   # file under the stdlib, token offset of the window
                 "prompt": [ids...],                          # prompt_len ids (the target's tokenizer)
                 "first": 17,                                 # the target's first token after the prompt
                 "rounds": [{"root": 17, "drafts": [5 ids], "accepted": 3, "bonus": 42}, ...]}, ...]}

Acceptance (`record_acceptance`, bench/capacity.py's `--acceptance FILE`): the per-round accepted lengths alone, as a
histogram, recorded the same way (greedy chains of k drafts, `record_one`) on the held-out prompts a user would
write (deploy/models/prompts/heldout.jsonl: function headers and docstrings from packages no model trained on), for
a replay that forces a target of other weights to the same acceptance (bench/forced_acceptance.py):

    {"format": "tether-acceptance", "version": 1, "target_fingerprint": "...", "drafter": "drafter",
     "prompt_file": "heldout.jsonl", "prompts": 64, "tokens": 128, "k": 5, "device": "cuda", "dtype": "bfloat16",
     "counts": [n0, n1, ..., nk],      # rounds of k drafts that accepted a = 0 .. k of them
     "tau": 3.1}                       # sum (a + 1) n_a / sum n_a: the recorded tokens per round

Round r's root is the previous round's bonus (round 0's: `first`); `drafts` are what the drafter proposed after it
(fewer than k only when the generation's last round had less room); `accepted` and `bonus` are the target's verdict,
kept for reference: a replay against the same target (same device and dtype, greedy) gets exactly these, elsewhere
the verdicts can drift, and the replay keeps sending round r's drafts after whatever root it actually has.

    python bench/server.py --record-traces traces.json --prompts 32       # the default target and drafter
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

import torch

from tether.server.engine import SpeculativeEngine

FORMAT = "tether-draft-traces"
VERSION = 1
# Besides the top-level modules: packages of ordinary application-style Python.
STDLIB_PACKAGES = ("asyncio", "email", "http", "importlib", "json", "logging", "unittest", "urllib", "xml/etree",
                   "concurrent/futures")  # fmt: skip


def stdlib_files() -> list[tuple[str, Path]]:
    """(name relative to the stdlib directory, path) of the Python files the prompts come from, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    for package in STDLIB_PACKAGES:
        files += sorted((root / package).glob("*.py"))
    return [(f.relative_to(root).as_posix(), f) for f in files if f.is_file()]


def stdlib_prompts(tokenizer, n: int, prompt_len: int) -> list[dict]:
    """n prompts of prompt_len token ids: one window from the middle of each of n files evenly spaced over those
    with at least 2 x prompt_len tokens. Deterministic for a given Python installation and tokenizer."""
    if n < 1 or prompt_len < 1:
        raise ValueError("n and prompt_len must be at least 1")
    eligible = []
    for name, path in stdlib_files():
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 2 * prompt_len:
            eligible.append((name, ids))
    if len(eligible) < n:
        raise ValueError(f"only {len(eligible)} standard-library files have {2 * prompt_len} tokens or more")
    picks = [eligible[i * len(eligible) // n] for i in range(n)]
    out = []
    for name, ids in picks:
        offset = (len(ids) - prompt_len) // 2
        out.append({"source": name, "offset": offset, "prompt": ids[offset : offset + prompt_len]})
    return out


class RecordingDrafter:
    """The engine's drafter, with each chain it proposes kept; everything else (the client part's begin and commit,
    the server part the verifier calls) goes to the drafter itself."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.pending: tuple[int, list[int]] | None = None  # (root, drafts) of the round being verified

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def draft(self, root: int, k: int, **kw):
        tokens, q_ids, q_probs = self.drafter.draft(root, k, **kw)
        self.pending = (root, list(tokens))
        return tokens, q_ids, q_probs


@torch.inference_mode()
def record_one(target, drafter, prompt: list[int], tokens: int, k: int) -> dict:
    """One prompt's trace: its first token and every round (root, drafts, accepted, bonus)."""
    rec = RecordingDrafter(drafter)
    engine = SpeculativeEngine(target, rec, k=k)
    chunks = engine.generate(prompt, tokens, temperature=0.0)
    first = next(chunks)[0]
    root, rounds = first, []
    for new in chunks:
        proposed_root, drafts = rec.pending if rec.pending is not None else (root, [])
        rec.pending = None
        if proposed_root != root:
            raise AssertionError(f"the drafter drafted after {proposed_root}, not the root {root}")
        rounds.append({"root": root, "drafts": drafts, "accepted": engine.stats.taus[-1] - 1, "bonus": new[-1]})
        root = new[-1]
    return {"first": first, "rounds": rounds}


def record(target, drafter, tokenizer, *, prompts: int, prompt_len: int, tokens: int, k: int = 5,
           target_fingerprint: str = "", drafter_dir: str | Path = "", progress=None) -> dict:  # fmt: skip
    """Traces of `prompts` standard-library prompts (see the module docstring); `progress(i, n)` after each."""
    if tokens < 2 or k < 1:
        raise ValueError("tokens must be at least 2 and k at least 1")
    if prompt_len + tokens + k + 1 > target.cfg.max_seq_len:
        raise ValueError(f"prompt_len + tokens must leave room within max_seq_len {target.cfg.max_seq_len}")
    w = target.embed_tokens.weight
    drafter_dir = Path(drafter_dir) if drafter_dir else None
    weights = drafter_dir / "drafter.safetensors" if drafter_dir else None
    out = {"format": FORMAT, "version": VERSION, "target_fingerprint": target_fingerprint,
           "drafter": drafter_dir.name if drafter_dir else "",
           "drafter_sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights and weights.exists() else "",
           "device": str(w.device), "dtype": str(w.dtype).removeprefix("torch."), "torch": torch.__version__,
           "python": platform.python_version(), "k": k, "temperature": 0.0, "prompt_len": prompt_len,
           "tokens": tokens, "traces": []}  # fmt: skip
    windows = stdlib_prompts(tokenizer, prompts, prompt_len)
    for i, window in enumerate(windows):
        out["traces"].append(window | record_one(target, drafter, window["prompt"], tokens, k))
        if progress:
            progress(i + 1, len(windows))
    return out


ACCEPTANCE_FORMAT = "tether-acceptance"


def heldout_prompts(tokenizer, path: str | Path, n: int) -> list[list[int]]:
    """The first n prompts of a held-out prompt file (bench/heldout_prompts.py's JSON lines), as token ids."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if n < 1 or len(lines) < n:
        raise ValueError(f"{path} holds {len(lines)} prompts; asked for {n}")
    return [tokenizer.encode(json.loads(line)["text"]) for line in lines[:n]]


def record_acceptance(target, drafter, tokenizer, *, prompt_file: str | Path, prompts: int, tokens: int, k: int = 5,
                      target_fingerprint: str = "", drafter_dir: str | Path = "", progress=None) -> dict:  # fmt: skip
    """The accepted-length histogram of greedy chains of k drafts, `tokens` after each of the first `prompts`
    held-out prompts (module docstring); rounds that had fewer than k drafts (a generation's last) are left out."""
    if tokens < 2 or k < 1:
        raise ValueError("tokens must be at least 2 and k at least 1")
    counts = [0] * (k + 1)
    windows = heldout_prompts(tokenizer, prompt_file, prompts)
    for i, prompt in enumerate(windows):
        for r in record_one(target, drafter, prompt, tokens, k)["rounds"]:
            if len(r["drafts"]) == k:
                counts[r["accepted"]] += 1
        if progress:
            progress(i + 1, len(windows))
    w = target.embed_tokens.weight
    return {"format": ACCEPTANCE_FORMAT, "version": VERSION, "target_fingerprint": target_fingerprint,
            "drafter": Path(drafter_dir).name if drafter_dir else "", "prompt_file": Path(prompt_file).name,
            "prompts": prompts, "tokens": tokens, "k": k, "device": str(w.device),
            "dtype": str(w.dtype).removeprefix("torch."), "counts": counts,
            "tau": sum((a + 1) * n for a, n in enumerate(counts)) / max(1, sum(counts))}  # fmt: skip


def load_acceptance(path: str | Path) -> dict:
    """An acceptance file, checked for its format, version and counts."""
    rec = json.loads(Path(path).read_text())
    if not isinstance(rec, dict) or rec.get("format") != ACCEPTANCE_FORMAT or rec.get("version") != VERSION:
        raise ValueError(f"{path} is not a {ACCEPTANCE_FORMAT} file of version {VERSION}")
    counts = rec.get("counts")
    if not isinstance(counts, list) or len(counts) < 2 or not all(isinstance(n, int) and n >= 0 for n in counts):
        raise ValueError(f"{path}: counts must be a list of k + 1 non-negative integers")
    return rec


def tau(trace: dict) -> float:
    """Tokens gained per round of a trace (accepted + bonus)."""
    rounds = trace["rounds"]
    return sum(r["accepted"] + 1 for r in rounds) / max(1, len(rounds))


def summary(traces: dict) -> dict:
    ts = traces["traces"]
    rounds = sum(len(t["rounds"]) for t in ts)
    gained = sum(r["accepted"] + 1 for t in ts for r in t["rounds"])
    taus = sorted(tau(t) for t in ts)
    return {"prompts": len(ts), "rounds": rounds, "tau": gained / max(1, rounds), "tau_min": taus[0],
            "tau_median": taus[len(taus) // 2], "tau_max": taus[-1]}  # fmt: skip


def save(path: str | Path, traces: dict) -> None:
    Path(path).write_text(json.dumps(traces, separators=(",", ":")) + "\n")


def load(path: str | Path) -> dict:
    """A trace file, checked for its format, version and the fields a replay reads."""
    traces = json.loads(Path(path).read_text())
    if not isinstance(traces, dict) or traces.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    if traces.get("version") != VERSION:
        raise ValueError(f"{path} is version {traces.get('version')}; this reads version {VERSION}")
    ok = isinstance(traces.get("traces"), list) and traces["traces"]
    for t in traces["traces"] if ok else ():
        ok = ok and isinstance(t.get("prompt"), list) and t["prompt"] and isinstance(t.get("first"), int)
        ok = ok and isinstance(t.get("rounds"), list) and t["rounds"]
        for r in t["rounds"] if ok else ():
            ok = ok and isinstance(r.get("root"), int) and isinstance(r.get("drafts"), list)
            ok = ok and isinstance(r.get("accepted"), int) and isinstance(r.get("bonus"), int)
    if not ok:
        raise ValueError(f"{path}: every trace needs a prompt, a first token and rounds of root, drafts, accepted, "
                         "bonus")  # fmt: skip
    return traces


if __name__ == "__main__":
    sys.exit("record traces with: python bench/server.py --record-traces FILE --prompts N")
