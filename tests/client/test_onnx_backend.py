"""The onnxruntime drafting backend drafts what the torch drafters draft, from exported graphs, without torch.

Both backends get the same server deltas for several rounds of chain and tree drafting, with logits compared at
every step. Accepted lengths run from none to all, so drafted rows after a rejection are rolled back, and a
fully accepted chain makes SA catch up on its last draft.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from tiny_models import tiny_pair, tiny_target
from toy_models import toy_model_dir

from tether.client.onnx_drafter import OnnxDrafter
from tether.server.onnx_export import export_client_onnx
from tether.server.verifier import SequenceVerifier, target_states
from tether.shared.codecs import Codec, decode_many, encode_many
from tether.shared.drafter import DraftDelta, DrafterConfig
from tether.shared.drafter_loading import build_drafter, load_drafter
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree
from tether.shared.tokenizer import Tokenizer

VOCAB = 7  # random tiny drafts then agree with the random tiny target often enough to accept 0..k tokens
PROMPT = [1, 2, 3, 4, 5, 6, 0, 1, 3]


def tiny(kind: str, tli: int = 1):
    return tiny_pair(kind, VOCAB, tli)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(kind, tli) -> (target, torch drafter, export dir); exported once per module."""
    made: dict = {}

    def get(kind: str, tli: int = 1):
        if (kind, tli) not in made:
            target, drafter = tiny(kind, tli)
            out = tmp_path_factory.mktemp(f"{kind}{tli}")
            export_client_onnx(drafter, out)
            made[kind, tli] = target, drafter, out
        return made[kind, tli]

    return get


def forward_steps(drafter) -> tuple[object, tuple[str, str]]:
    """Where a drafter's one-token and tree-level forwards are: a torch module's _step / _tree_step, the ONNX
    backend's step / tree_step."""
    if isinstance(drafter, OnnxDrafter):
        return drafter.backend, ("step", "tree_step")
    return drafter, ("_step", "_tree_step")


def recording(monkeypatch, drafter, log: list) -> None:
    """Log every logits row the drafter's forwards return, as numpy."""
    owner, names = forward_steps(drafter)
    for name in names:
        inner = getattr(owner, name)

        def wrapped(*args, _inner=inner):
            out = _inner(*args)
            log.append(out.float().numpy() if isinstance(out, torch.Tensor) else out)
            return out

        monkeypatch.setattr(owner, name, wrapped)


class ForcedServer:
    """The target's side of each round with the verdict chosen by the test: the deltas hold the target's real
    states for the positions the test declares accepted, so none, some and all drafts get accepted on schedule
    (random tiny models alone would mostly accept none)."""

    def __init__(self, target, drafter, capacity: int = 256):
        self.target, self.drafter = target, drafter
        self.cache = target.new_cache(1, capacity)

    def _run(self, tokens, **kw):
        return self.target.verify(
            tokens[None], self.cache, hidden_layers=(self.target.cfg.n_layers,), return_kv=True, **kw
        )

    @torch.inference_mode()
    def open(self, prompt: list[int]) -> tuple[int, DraftDelta]:
        out = self._run(torch.tensor(prompt))
        self.cache.advance(len(prompt))
        return int(out.logits[0, -1].argmax()), self.drafter.server_delta(target_states(out), 0, prompt)

    @torch.inference_mode()
    def verify(self, tree: DraftTree, path: list[int]) -> tuple[int, DraftDelta]:
        start = self.cache.length
        out = self._run(tree.tokens, tree_mask=tree.ancestor_mask(), positions=tree.positions(start))
        self.cache.accept(path)
        delta = self.drafter.server_delta(target_states(out).select(path), start, tree.tokens[path].tolist())
        return int(out.logits[0, path[-1]].argmax()), delta


def rounds(target, ref, onnx, prompt, *, n_rounds, k, tree_every=0, forced=True) -> list[int]:
    """Draft with both backends on identical deltas; assert identical drafts. Returns accepted counts.
    forced: chains accept 0, k, 1, k - 1, ... drafts in turn and trees alternate between rejecting everything and
    accepting their deepest path; otherwise the target decides (SequenceVerifier)."""
    server = ForcedServer(target, ref) if forced else SequenceVerifier(target, ref, capacity=256)
    root, delta = server.open(prompt)
    ref.begin(delta)
    onnx.begin(delta)
    accepted = []
    for r in range(n_rounds):
        if tree_every and r % tree_every == tree_every - 1:
            tree = ref.draft_tree(root, depth=3, top_k=2, total_tokens=6)
            got = onnx.draft_tree(root, depth=3, top_k=2, total_tokens=6)
            assert (got.tokens, got.parents) == (tree.tokens.tolist(), tree.parents.tolist()), f"round {r}"
            assert got.source_ids == tree.source_ids.tolist()
            path = [0] if r % 2 else tree.path_to(int(tree.depths.argmax()))
        else:
            want, _, _ = ref.draft(root, k)
            got, _, _ = onnx.draft(root, k)
            assert got == want, f"round {r}"
            tree = DraftTree.chain(root, want)
            path = list(range(1 + [0, k, 1, k - 1][r % 4]))
        if forced:
            root, delta = server.verify(tree, path)
            accepted.append(len(path) - 1)
        else:
            verdict, delta = server.verify(tree)
            root = verdict.bonus
            accepted.append(verdict.accepted)
        ref.commit(delta)
        onnx.commit(delta)
    assert onnx.verified_length() == ref.verified_length() == server.cache.length
    return accepted


def check_logits(ref_log: list, onnx_log: list) -> None:
    assert len(ref_log) == len(onnx_log) > 0
    for a, b in zip(ref_log, onnx_log, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tli", [0, 1, 2, 3])
def test_moa_drafts_match_torch(exported, monkeypatch, tli):
    target, ref, out = exported("moa", tli)
    onnx = OnnxDrafter.load(out)
    ref_log, onnx_log = [], []
    recording(monkeypatch, ref, ref_log)
    recording(monkeypatch, onnx, onnx_log)
    rounds(target, ref, onnx, PROMPT, n_rounds=10, k=4, tree_every=5)
    check_logits(ref_log, onnx_log)


class CountingSession:
    """An onnxruntime session that counts its runs."""

    def __init__(self, inner):
        self.inner, self.runs = inner, 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return self.inner.run(*args, **kwargs)


@pytest.mark.parametrize("tli", [0, 1, 3])
@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_moa_feeds_known_tokens_in_one_call_as_step_by_step(exported, monkeypatch, backend, tli):
    """feed() (a round sent, drafted ahead of its verdict) leaves the rows one step per token leaves: the guess
    after it and the drafts from those rows agree, in one graph call instead of one per token."""
    target, ref, out = exported("moa", tli)
    if backend == "torch":
        drafter, calls = ref, []
        for name in ("_step", "_tree_step"):
            inner = getattr(drafter, name)
            monkeypatch.setattr(drafter, name, lambda *a, _f=inner: calls.append(1) or _f(*a))
        count = calls.__len__
    else:
        drafter = OnnxDrafter.load(out)
        drafter.backend.sessions = {**drafter.sessions, "step": CountingSession(drafter.sessions["step"])}
        count = lambda: drafter.sessions["step"].runs  # noqa: E731
    root, delta = ForcedServer(target, ref).open(PROMPT)
    drafter.begin(delta)
    known = [root, 3, 5, 1, 6]
    before = count()
    batched_guess = drafter.feed(known)
    assert count() - before == 1  # one causal call for the five tokens
    log: list = []
    recording(monkeypatch, drafter, log)
    batched, _, _ = drafter.draft(batched_guess, 3)
    drafter.discard_drafts()
    for t in known:
        (stepped_guess,), _, _ = drafter.draft(t, 1)
    stepped, _, _ = drafter.draft(stepped_guess, 3)
    assert (batched_guess, batched) == (stepped_guess, stepped)
    check_logits(log[:3], log[-3:])  # drafting from the fed rows computes what it computes from stepped rows
    drafter.discard_drafts()
    assert drafter.verified_length() == len(PROMPT)
    assert drafter.feed([]) is None


@pytest.mark.parametrize("tli", [1, 2])
def test_moa_with_depth_predictor_drafts_match_torch(tmp_path, monkeypatch, tli):
    """With tli_depth > 0 the depth predictor feeding TLI is in the step graph: ONNX drafts what torch drafts."""
    target = tiny_target(vocab_size=VOCAB)
    torch.manual_seed(2)
    dcfg = DrafterConfig(kind="moa", tli=tli, n_heads=4, n_kv_heads=2, head_dim=12, tli_depth=24)
    ref = build_drafter(target, dcfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    export_client_onnx(ref, tmp_path)
    onnx = OnnxDrafter.load(tmp_path)
    assert onnx.manifest["drafter_config"]["tli_depth"] == 24
    ref_log, onnx_log = [], []
    recording(monkeypatch, ref, ref_log)
    recording(monkeypatch, onnx, onnx_log)
    rounds(target, ref, onnx, PROMPT, n_rounds=6, k=4, tree_every=3)
    check_logits(ref_log, onnx_log)


def test_eagle_drafts_match_torch(exported, monkeypatch):
    target, ref, out = exported("eagle")
    onnx = OnnxDrafter.load(out)
    ref_log, onnx_log = [], []
    recording(monkeypatch, ref, ref_log)
    recording(monkeypatch, onnx, onnx_log)
    rounds(target, ref, onnx, PROMPT, n_rounds=10, k=3, tree_every=5)
    check_logits(ref_log, onnx_log)


@pytest.fixture(scope="module")
def toy_target():
    return Transformer.from_pretrained(toy_model_dir(), dtype=torch.float32)


@pytest.mark.parametrize("name", ["drafter", "drafter-eagle"])
def test_the_toy_drafters_match_torch(toy_target, tmp_path, monkeypatch, name):
    ref = load_drafter(toy_model_dir(name), toy_target)
    export_client_onnx(ref, tmp_path)
    onnx = OnnxDrafter.load(tmp_path)
    ref_log, onnx_log = [], []
    recording(monkeypatch, ref, ref_log)
    recording(monkeypatch, onnx, onnx_log)
    prompt = Tokenizer.from_pretrained(toy_model_dir()).encode("import os\nimport sys\n\n\ndef main(argv):\n")
    k = 5
    accepted = rounds(toy_target, ref, onnx, prompt, n_rounds=10, k=k, tree_every=3, forced=False)
    check_logits(ref_log, onnx_log)
    assert k in accepted and any(a < k for a in accepted), accepted  # the target accepts all, and not all


def test_sampled_draft_carries_the_torch_distribution(exported):
    target, ref, out = exported("moa", 2)
    onnx = OnnxDrafter.load(out)
    _, delta = SequenceVerifier(target, ref, capacity=64).open(PROMPT)
    settings = dict(temperature=0.7, top_p=0.9, support=4)
    ref.begin(delta)
    _, want_ids, want_probs = ref.draft(PROMPT[-1], 1, **settings, generator=torch.Generator().manual_seed(0))
    draws = []
    for seed in (0, 0, 1):
        onnx.begin(delta)
        tokens, q_ids, q_probs = onnx.draft(PROMPT[-1], 1, **settings, generator=seed)
        assert q_ids.dtype == np.int64 and q_probs.dtype == np.float32 and q_ids.shape == q_probs.shape == (1, 4)
        # top-p keeps a prefix: the truncated support matches wherever the torch drafter gave mass.
        kept = want_probs[0].numpy() > 0
        assert q_ids[0][kept].tolist() == want_ids[0][kept].tolist()
        np.testing.assert_allclose(q_probs[0], want_probs[0].numpy(), rtol=1e-4, atol=1e-5)
        assert q_probs[0][q_ids[0].tolist().index(tokens[0])] > 0
        draws.append(tokens)
    assert draws[0] == draws[1]  # a seed makes the draw repeatable
    onnx.begin(delta)
    tokens, q_ids, q_probs = onnx.draft(PROMPT[-1], 3, temperature=1.0, generator=np.random.default_rng(5))
    assert len(tokens) == 3 and q_ids.shape == (3, VOCAB) and np.allclose(q_probs.sum(-1), 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_a_chain_stopped_and_gone_on_with_is_the_chain_never_stopped(exported, backend, temperature):
    """draft(stop=) ends a chain early (asked after each token but the last); draft(tokens[-1], the rest) with the
    same generator then gives the tokens, q rows and cache rows of one uninterrupted draft."""
    target, ref, out = exported("moa", 2)
    drafter = ref if backend == "torch" else OnnxDrafter.load(out)
    _, delta = SequenceVerifier(target, ref, capacity=64).open(PROMPT)

    def rng():
        return torch.Generator().manual_seed(3) if backend == "torch" else np.random.default_rng(3)

    settings = dict(temperature=temperature, top_p=1.0, support=4)
    drafter.begin(delta)
    whole = drafter.draft(PROMPT[-1], 5, **settings, generator=rng())
    after_whole = drafter.draft(whole[0][-1], 1)[0]  # the next token: it reads the rows the draft left
    asked = []
    drafter.begin(delta)
    g = rng()
    first = drafter.draft(PROMPT[-1], 5, **settings, stop=lambda: asked.append(1) or len(asked) == 2, generator=g)
    assert len(first[0]) == 2 and len(asked) == 2
    rest = drafter.draft(first[0][-1], 3, **settings, generator=g)
    assert first[0] + rest[0] == whole[0]
    assert drafter.draft(rest[0][-1], 1)[0] == after_whole
    if temperature == 0:
        assert whole[1] is None and first[1] is None
    else:
        assert np.array_equal(np.concatenate([np.asarray(first[1]), np.asarray(rest[1])]), np.asarray(whole[1]))
        np.testing.assert_array_equal(np.concatenate([np.asarray(first[2]), np.asarray(rest[2])]), np.asarray(whole[2]))
    drafter.begin(delta)
    assert len(drafter.draft(PROMPT[-1], 3, stop=lambda: False)[0]) == 3  # never asked to stop: the whole chain


def test_cache_capacity_and_delta_order_are_checked(exported):
    target, ref, out = exported("moa", 1)
    onnx = OnnxDrafter.load(out)
    ver = SequenceVerifier(target, ref, capacity=64)
    _, delta = ver.open(PROMPT)
    onnx.begin(delta, capacity=len(PROMPT) + 2)
    with pytest.raises(ValueError, match="cache full"):
        onnx.draft(PROMPT[-1], 5)
    onnx.begin(delta)
    with pytest.raises(ValueError, match="starts at 0"):
        onnx.commit(delta)
    with pytest.raises(ValueError, match="position 0"):
        onnx.begin(DraftDelta(start=3, tokens=[1], tensors=delta.tensors))


def test_manifest_and_tampered_graphs(exported, tmp_path):
    _, ref, out = exported("moa", 3)
    manifest = json.loads((out / "onnx_drafter.json").read_text())
    assert manifest["kind"] == "moa" and manifest["shapes"]["tli"] == 3
    assert manifest["graphs"]["step"]["inputs"][-2:] == ["tli_k.2", "tli_v.2"]
    assert set(manifest["graphs"]) == {"step", "context"} and all(
        len(g["sha256"]) == 64 for g in manifest["graphs"].values()
    )
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    with open(bad / "context.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="sha256"):
        OnnxDrafter.load(bad)
    with pytest.raises(FileNotFoundError):
        OnnxDrafter.load(tmp_path)


def test_a_bf16_drafter_exports_in_fp32_and_stays_bf16(tmp_path):
    target, drafter = tiny("moa", 2)
    target.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    export_client_onnx(drafter, tmp_path / "bf16")
    assert drafter.sa.attn.q_proj.weight.dtype == target.embed_tokens.weight.dtype == torch.bfloat16
    target.float()
    drafter.float()
    export_client_onnx(drafter, tmp_path / "fp32")
    # The same graphs as exporting the bf16 values widened to fp32 by hand.
    digests = [json.loads((tmp_path / d / "onnx_drafter.json").read_text())["graphs"] for d in ("bf16", "fp32")]
    assert digests[0] == digests[1]
    assert OnnxDrafter.load(tmp_path / "bf16").kind == "moa"


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules["torch"] = None  # any import of torch now fails
    from pathlib import Path

    from tether.shared.wire import decode_many
    from tether.client.onnx_drafter import ArrayDelta, OnnxDrafter

    work = Path(sys.argv[1])
    rounds = json.loads((work / "rounds.json").read_text())
    drafter = OnnxDrafter.load(work / "onnx")
    deltas = [ArrayDelta(r["start"], r["tokens"], decode_many((work / f"delta{i}.bin").read_bytes()))
              for i, r in enumerate(rounds)]
    drafts = []
    for i, (r, delta) in enumerate(zip(rounds, deltas)):
        drafter.begin(delta) if i == 0 else drafter.commit(delta)
        drafts.append(drafter.draft(r["root"], 4)[0])
    drafter.begin(deltas[0])
    tree = drafter.draft_tree(rounds[0]["root"], depth=2, top_k=2, total_tokens=4)
    sampled, q_ids, q_probs = drafter.draft(rounds[0]["root"], 2, temperature=0.8, generator=0)
    loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "torch" and mod is not None)
    print(json.dumps({"drafts": drafts, "tree": len(tree), "q": q_probs.shape, "torch": loaded}))
    """
)


def test_onnx_backend_runs_without_torch(exported, tmp_path):
    """Deltas cross a wire codec (INT8, lossy), then a child process with torch blocked decodes and drafts."""
    target, ref, out = exported("moa", 2)
    shutil.copytree(out, tmp_path / "onnx")
    ver = SequenceVerifier(target, ref, capacity=64)
    root, delta = ver.open(PROMPT)
    meta, want = [], []
    for i in range(4):
        wire = encode_many(delta.tensors, Codec.INT8_ZSTD)
        (tmp_path / f"delta{i}.bin").write_bytes(wire)
        received = DraftDelta(delta.start, delta.tokens, decode_many(wire))  # what a torch client would adopt
        ref.begin(received) if i == 0 else ref.commit(received)
        meta.append({"start": delta.start, "tokens": delta.tokens, "root": root})
        want.append(ref.draft(root, 4)[0])
        verdict, delta = ver.verify(DraftTree.chain(root, want[-1]))
        root = verdict.bonus
    (tmp_path / "rounds.json").write_text(json.dumps(meta))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"drafts": want, "tree": 4, "q": [2, VOCAB], "torch": []}
