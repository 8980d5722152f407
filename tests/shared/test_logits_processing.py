"""Sampling controls (tether.shared.logits_processing): validation, the processed logits against vLLM's formulas
written out by hand, numpy against torch, and exactness under speculation: the batched verifier equals the scalar
one with penalties, one sampled verification step emits tokens by the processed target distribution with each
position's own path counts (chi-square), and greedy with penalties / logit_bias / min_p through the in-process
speculative engine (chain, tree and plain) equals the model's own step-by-step greedy decoding with the same rule."""

import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_acceptance import KINDS, random_case
from test_speculative import N, assert_matches, total_variation
from tiny_models import tiny_pair

import tether.shared.attention as attention
from tether.kernels.moda import moda_backend
from tether.kernels.utils import interpreting
from tether.server.engine import SpeculativeEngine
from tether.server.kv_pool import KVPool
from tether.server.rounds import verify_batch
from tether.server.verifier import SequenceVerifier
from tether.shared.acceptance import verify_rows
from tether.shared.logits_processing import ControlError, ProcessingRows, SamplingControls
from tether.shared.sampling import probabilities_np
from tether.shared.speculative import DraftTree, target_probs, verify

# ---------------------------------------------------------------------------------------------- the controls


@pytest.mark.parametrize(
    "kwargs,control",
    [(dict(presence_penalty=2.01), "presence_penalty"), (dict(presence_penalty=math.nan), "presence_penalty"),
     (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
     (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
     (dict(logit_bias={3: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
     (dict(logit_bias={2.5: 1.0}), "logit_bias"), (dict(logit_bias=[(1, 1.0), (1, 2.0)]), "logit_bias"),
     (dict(logit_bias={1: math.inf}), "logit_bias"), (dict(temperature=-1.0), "temperature"),
     (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(temperature=math.inf), "temperature")],
)  # fmt: skip
def test_bad_controls_name_the_control(kwargs, control):
    with pytest.raises(ControlError) as e:
        SamplingControls(**kwargs)
    assert e.value.control == control and isinstance(e.value, ValueError)


def test_controls_edges_vocabulary_and_identity():
    edges = SamplingControls(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, min_p=1,
                             logit_bias={0: -100, 9: 100})  # fmt: skip
    with pytest.raises(ControlError, match="outside the vocabulary of 9") as e:
        edges.check_vocab(9)
    assert e.value.control == "logit_bias"
    edges.check_vocab(10)
    # Given as a dict or as pairs, the controls are the same value (hashable: a frozen configuration).
    a, b = SamplingControls(logit_bias={3: 1.0, 1: -2}), SamplingControls(logit_bias=[(1, -2.0), (3, 1)])
    assert a == b and hash(a) == hash(b) and a.logit_bias == ((1, -2.0), (3, 1.0))
    assert SamplingControls(temperature=1.0, min_p=0.2).processing([1, 2], 1, 10) is None  # nothing to process
    assert not SamplingControls(logit_bias={1: 0.0}).processes_logits
    bias_only = SamplingControls(logit_bias={1: 0.5})
    assert bias_only.processes_logits and not bias_only.penalised


def test_importing_the_controls_leaves_torch_out():
    """The edge's torch-free drafter processes its logits with this module."""
    code = "import sys, tether.shared.logits_processing; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- the rule


def test_processing_follows_the_vllm_formulas():
    """Bias first; repetition over prompt and generated (positive divided, others multiplied); frequency and
    presence over generated tokens only."""
    controls = SamplingControls(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                                logit_bias={5: 3.0, 3: -1.0})  # fmt: skip
    prompt, generated = [0, 4, 3], [1, 1, 2]
    proc = controls.processing(prompt + generated, len(prompt), 6)
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0, -2.0], np.float32)
    # token 0: prompt, 2 / 2; 1: generated twice, -1 * 2 - 0.5 * 2 - 0.25; 2: generated once, 0.5 / 2 - 0.5 - 0.25;
    # 3: prompt, biased, (3 - 1) / 2; 4: prompt, 0 * 2; 5: unseen, -2 + 3.
    np.testing.assert_array_equal(proc.apply_np(logits), [1.0, -3.25, -0.5, 1.0, 0.0, 1.0])
    # A prompt token's repeat in the output counts for frequency and presence, once generated.
    np.testing.assert_array_equal(proc.after([4, 4]).apply_np(logits), [1.0, -3.25, -0.5, 1.0, -1.25, 1.0])
    longer = controls.processing(prompt + generated + [4, 4], len(prompt), 6)
    np.testing.assert_array_equal(longer.apply_np(logits), proc.after([4, 4]).apply_np(logits))


def test_numpy_and_torch_rules_agree():
    """Per-row torch processing (each row its own controls and counts) equals the numpy one bit for bit, and the
    distributions after temperature, top-k, top-p and min-p agree; min-p drops exactly the tokens below min_p x max."""
    V = 37
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 3
    rng = random.Random(1)
    rows_controls = [
        SamplingControls(temperature=0.8, presence_penalty=0.7, frequency_penalty=-0.3, min_p=0.05),
        SamplingControls(temperature=1.2, repetition_penalty=1.7, logit_bias={3: 30.0, 30: -100}, top_k=9),
        SamplingControls(temperature=1.0, top_p=0.8),  # processes nothing: its row is None
        SamplingControls(temperature=0.5, repetition_penalty=0.6, frequency_penalty=2.0, top_p=0.9, min_p=0.2),
        SamplingControls(temperature=2.0, presence_penalty=-2.0, logit_bias={0: 1.5}, top_k=20, min_p=0.5),
    ]
    contexts = [[rng.randrange(V) for _ in range(rng.randint(1, 30))] for _ in rows_controls]
    procs = [c.processing(ctx, len(ctx) // 2, V) for c, ctx in zip(rows_controls, contexts, strict=True)]
    assert procs[2] is None
    got = ProcessingRows.stack(procs, V).apply(logits)  # [5, V] float64
    want = np.stack([logits[b].double().numpy() if p is None else p.apply_np(logits[b].numpy())
                     for b, p in enumerate(procs)])  # fmt: skip
    assert torch.equal(got, torch.from_numpy(want))
    per_row = {k: torch.tensor([getattr(c, k) for c in rows_controls])
               for k in ("temperature", "top_p", "top_k", "min_p")}  # fmt: skip
    p_torch = target_probs(got, per_row["temperature"], per_row["top_p"], per_row["top_k"], per_row["min_p"])
    for b, c in enumerate(rows_controls):
        p_np = probabilities_np(want[b], c.temperature, c.top_p, c.top_k, c.min_p)
        np.testing.assert_allclose(p_torch[b].numpy(), p_np, rtol=0, atol=2e-6)
        before = target_probs(got[b], c.temperature, c.top_p, c.top_k)  # [V] without min-p
        kept = before >= c.min_p * before.max()
        assert torch.equal(p_torch[b] > 0, kept & (before > 0))
    # Greedy is the argmax of the processed logits.
    assert probabilities_np(want[1], 0.0).argmax() == want[1].argmax() != logits[1].argmax()


# ---------------------------------------------------------------------------------------------- verification


def random_controls(rng: random.Random, temperature: float, top_p: float, top_k: int) -> SamplingControls:
    return SamplingControls(temperature=temperature, top_p=top_p, top_k=top_k, min_p=rng.choice([0.0, 0.1, 0.3]),
                            presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                            repetition_penalty=rng.uniform(0.5, 2.0),
                            logit_bias={rng.randrange(37): rng.uniform(-5, 5) for _ in range(3)})  # fmt: skip


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_verify_rows_equals_verify_with_penalties(kind, device):
    """The batched verifier's per-node path counts give the scalar walk's verdict, row by row, from the same
    seeds (on the CPU's logits, or on the GPU's); one row in three processes nothing, so rows with and without
    processing mix in the batch."""
    rng = random.Random(kind)
    trees, logits, controls, procs = [], [], [], []
    for i in range(24):
        tree, rows, temperature, top_p, top_k = random_case(rng, kind)
        c = random_controls(rng, temperature, top_p, top_k)
        context = [rng.randrange(37) for _ in range(rng.randint(1, 12))] + [int(tree.tokens[0])]
        proc = None if i % 3 == 2 else c.processing(context, rng.randrange(len(context)), 37)
        trees.append(tree), logits.append(rows), controls.append(c), procs.append(proc)
    T = max(len(t) for t in trees)
    padded = torch.zeros(len(trees), T, 37)
    for b, rows in enumerate(logits):
        padded[b, : rows.shape[0]] = rows
    want = [verify(t, rows, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, min_p=c.min_p, processing=p,
                   generator=torch.Generator().manual_seed(b))
            for b, (t, rows, c, p) in enumerate(zip(trees, logits, controls, procs, strict=True))]  # fmt: skip
    got = verify_rows(trees, padded.to(device), [c.temperature for c in controls], [c.top_p for c in controls],
                      [torch.Generator().manual_seed(b) for b in range(len(trees))], [c.top_k for c in controls],
                      min_ps=[c.min_p for c in controls], processing=procs)  # fmt: skip
    assert got == want
    plain = [verify(t, rows, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                    generator=torch.Generator().manual_seed(b))
             for b, (t, rows, c) in enumerate(zip(trees, logits, controls, strict=True))]  # fmt: skip
    assert plain != want  # the processing decided some verdicts


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_step_follows_the_processed_distribution(device):
    """Root -> d1 (a deterministic pick) -> d2 (sampled from q), every row of a context-independent target the same
    logits: the first emitted token follows p0, the root position's processed distribution, and the token after an
    accepted d1 follows p1, the same logits processed with d1 counted once more. p1 is far from p0, so a verifier
    that processed node 1 with the root's counts would fail the second test."""
    V = 6
    logits = 1.5 * torch.randn(V, generator=torch.Generator().manual_seed(3))  # [V]
    controls = SamplingControls(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4,
                                min_p=0.04, logit_bias={2: 1.5, 4: -100})  # fmt: skip
    prompt, generated = [0, 3], [1, 5, 1]
    proc = controls.processing(prompt + generated, len(prompt), V)

    def processed_p(after: list[int]) -> torch.Tensor:  # [V]
        x = torch.from_numpy(proc.after(after).apply_np(logits.numpy()))
        return target_probs(x, controls.temperature, min_p=controls.min_p)

    p0 = processed_p([])
    d1 = int(p0.argmax())
    p1 = processed_p([d1])
    assert total_variation(p1 * N, p0) > 0.05 and float(p0[4]) == 0  # the path counts matter; bias -100 bites
    q_ids = torch.tensor([[d1, d1, d1], [1, 2, 5]])  # [2, 3] d1 a point mass, d2 drawn from q
    q_probs = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.3, 0.2]])
    g = torch.Generator().manual_seed(0)
    d2 = torch.multinomial(q_probs[1], N, replacement=True, generator=g)  # [N]
    trees = [DraftTree.chain(0, [d1, int(q_ids[1, d])], q_ids, q_probs) for d in d2.tolist()]
    rows = logits[None, None].expand(N, 3, V).to(device)
    verdicts = verify_rows(trees, rows, [controls.temperature] * N, [1.0] * N, [g] * N, min_ps=[controls.min_p] * N,
                           processing=[proc] * N)  # fmt: skip
    first, second = torch.zeros(V), torch.zeros(V)
    for tree, v in zip(trees, verdicts, strict=True):
        emitted = v.emitted_tokens(tree)
        first[emitted[0]] += 1
        if v.accepted:
            second[emitted[1]] += 1
    assert second.sum() > N / 4
    assert_matches(first, p0)
    assert_matches(second, p1)


# ---------------------------------------------------------------------------------------------- the engine

VOCAB = 7
CONTROLS = {
    "presence": SamplingControls(presence_penalty=1.5),
    "frequency": SamplingControls(frequency_penalty=0.7),
    "repetition": SamplingControls(repetition_penalty=1.8),
    "logit_bias": SamplingControls(logit_bias={1: 2.0, 4: -100}),
    "all": SamplingControls(
        presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.3, logit_bias={2: 0.7}
    ),  # fmt: skip
}
PROMPTS = [[3, 1, 4, 1, 0, 2, 4], [4, 4, 2, 2, 3, 0]]


def plain_greedy(target, prompt: list[int], n: int, controls: SamplingControls) -> list[int]:
    """The model's own step-by-step decoding through its KV cache, each token the argmax of the numpy rule's
    processed logits over the sequence so far."""
    cache = target.new_cache(1, len(prompt) + n)
    logits = target.prefill(torch.tensor([prompt], device=target.device), cache, last_only=True).logits[0, -1]
    out: list[int] = []
    for _ in range(n):
        proc = controls.processing(prompt + out, len(prompt), VOCAB)
        x = logits.float().cpu().numpy()
        x = x if proc is None else proc.apply_np(x)
        out.append(int(probabilities_np(x, controls.temperature, min_p=controls.min_p).argmax()))
        logits = target.prefill(torch.tensor([out[-1:]], device=target.device), cache).logits[0, -1]
    return out


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("moa", VOCAB)


@pytest.mark.parametrize("name", list(CONTROLS))
@pytest.mark.parametrize("mode", ["chain", "tree", "plain"])
@torch.inference_mode()
def test_greedy_speculation_with_controls_equals_plain_greedy(pair, name, mode):
    target, drafter = pair
    tree = (3, 3, 8) if mode == "tree" else None
    engine = SpeculativeEngine(target, None if mode == "plain" else drafter, k=4, tree=tree)
    controls, changed, accepted = CONTROLS[name], False, 0
    for prompt in PROMPTS:
        got = [t for chunk in engine.generate(prompt, 24, controls=controls) for t in chunk]
        assert got == plain_greedy(target, prompt, 24, controls)
        changed |= got != plain_greedy(target, prompt, 24, SamplingControls())
        accepted += engine.stats.accepted
    assert changed  # the controls decided some tokens: the equality is not that of plain greedy
    if mode != "plain":
        assert accepted > 0  # accepted drafts: later positions were verified with counts of drafted tokens


@pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="the kernels need CUDA or TRITON_INTERPRET"
)
@pytest.mark.parametrize("mode", ["chain", "plain"])
@torch.inference_mode()
def test_greedy_with_controls_through_the_step_runner(monkeypatch, mode):
    """On the "triton" backend the engine's sequence lives in a paged pool and every round is a fixed-shape step:
    its in-step greedy verdict, made from raw logits, is set aside for the processed one, and plain decoding
    leaves the chained one-token steps for verify rounds."""
    monkeypatch.setitem(attention._BACKENDS, "triton", moda_backend)
    target, drafter = tiny_pair("moa", VOCAB)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = target.to(dev), drafter.to(dev)
    controls = CONTROLS["all"]
    want = plain_greedy(target, PROMPTS[0], 16, controls)
    target.backend = "triton"
    engine = SpeculativeEngine(target, drafter if mode == "chain" else None, k=4)
    assert [t for chunk in engine.generate(PROMPTS[0], 16, controls=controls) for t in chunk] == want
    assert engine._pool is not None  # the paged pool and its step runner served the rounds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["chain", "tree"])
@torch.inference_mode()
def test_greedy_speculation_with_controls_on_cuda(mode):
    target, drafter = tiny_pair("moa", VOCAB)
    target, drafter = target.to("cuda"), drafter.to("cuda")
    engine = SpeculativeEngine(target, drafter, k=4, tree=(3, 3, 8) if mode == "tree" else None)
    for name, controls in CONTROLS.items():
        for prompt in PROMPTS:
            got = [t for chunk in engine.generate(prompt, 24, controls=controls) for t in chunk]
            assert got == plain_greedy(target, prompt, 24, controls), name


@pytest.mark.parametrize("mode", ["chain", "tree"])
@torch.inference_mode()
def test_sampled_speculation_never_emits_a_banned_token(pair, mode):
    target, drafter = pair
    engine = SpeculativeEngine(target, drafter, k=4, tree=(3, 3, 8) if mode == "tree" else None)
    controls = SamplingControls(temperature=1.0, presence_penalty=0.5, logit_bias={1: -100, 4: -100})
    g = torch.Generator().manual_seed(0)
    out = [t for p in PROMPTS for chunk in engine.generate(p, 40, controls=controls, generator=g) for t in chunk]
    assert len(out) == 80 and not {1, 4} & set(out)


def test_engine_refuses_controls_twice_and_a_bias_outside_the_vocabulary(pair):
    target, drafter = pair
    engine = SpeculativeEngine(target, drafter)
    with pytest.raises(TypeError, match="not both"):
        next(engine.generate([1, 2], 4, temperature=0.5, controls=SamplingControls()))
    with pytest.raises(ControlError, match="outside the vocabulary"):
        next(engine.generate([1, 2], 4, controls=SamplingControls(logit_bias={VOCAB: 1.0})))


def branchy_tree(root: int, oracle: list[int], rng: random.Random) -> DraftTree:
    """root -> {a random token, oracle[0] -> {oracle[1] -> oracle[2], a random token}}: long accepted paths beside
    rejected siblings (oracle: the reference's next tokens, cut short at random)."""
    cut = oracle[: rng.randint(0, len(oracle))] + [rng.randrange(VOCAB) for _ in range(3)]
    tokens = [root, rng.randrange(VOCAB), cut[0], cut[1], rng.randrange(VOCAB), cut[2]]
    return DraftTree(torch.tensor(tokens), torch.tensor([-1, 0, 0, 2, 2, 3]))


@pytest.mark.parametrize("paged", [False, True])
@torch.inference_mode()
def test_one_batch_of_sequences_with_different_controls(pair, paged):
    """verify_batch over sequences that each have their own controls (one plain among them), every round of all
    of them in one target forward: each sequence's output equals plain greedy decoding with its own controls."""
    target, _ = pair
    rules = [CONTROLS["presence"], CONTROLS["all"], SamplingControls(), CONTROLS["logit_bias"], CONTROLS["repetition"]]
    prompts = [PROMPTS[b % 2] for b in range(len(rules))]
    n = 20
    pool = KVPool(target.cfg, 48, 8, device=target.device, dtype=torch.float32) if paged else None
    vers = [SequenceVerifier(target, None, capacity=len(p) + n + 8, controls=c, pool=pool)
            for p, c in zip(prompts, rules, strict=True)]  # fmt: skip
    want = [plain_greedy(target, p, n, c) for p, c in zip(prompts, rules, strict=True)]
    outs = [[v.open(p)[0]] for v, p in zip(vers, prompts, strict=True)]
    rng, longest = random.Random(0), 0
    while True:
        live = [b for b in range(len(vers)) if len(outs[b]) < n]
        if not live:
            break
        items = [(vers[b], branchy_tree(outs[b][-1], want[b][len(outs[b]) :][:3], rng)) for b in live]
        for b, (_, tree), result in zip(live, items, verify_batch(target, items), strict=True):
            outs[b] += result[0].emitted_tokens(tree)
            longest = max(longest, result[0].accepted)
    assert [o[:n] for o in outs] == want
    assert longest == 3  # whole paths of drafted tokens were accepted, each position with its path's counts
    assert len({tuple(w) for w in want}) > 2  # the controls made the sequences differ


@torch.inference_mode()
def test_absorb_judges_offline_tokens_by_the_processed_rule(pair):
    """A resync's absorb keeps the offline tokens the penalised target agrees with and answers its next token
    from the counts through them; verification then goes on exactly."""
    target, _ = pair
    controls, prompt = CONTROLS["all"], PROMPTS[0]
    want = plain_greedy(target, prompt, 12, controls)
    assert want[:7] != plain_greedy(target, prompt, 7, SamplingControls())  # the controls decide these tokens
    ver = SequenceVerifier(target, None, capacity=40, controls=controls)
    assert ver.open(prompt)[0] == want[0]
    wrong = next(t for t in range(VOCAB) if t != want[6])
    disagreement, nxt, _ = ver.absorb(len(prompt), want[:6] + [wrong], rewind=True)
    assert (disagreement, nxt) == (6, want[6])
    tree = DraftTree.chain(nxt, want[7:10])
    assert ver.verify(tree)[0].emitted_tokens(tree) == want[7:11]


@torch.inference_mode()
def test_a_history_opened_with_its_prompt_length_counts_its_generated_tokens(pair):
    """A sequence opened on prompt + generated tokens (a resync's history) with the prompt's length answers what
    decoding on from the prompt answers; counted all as prompt, the presence penalty would miss its generated ones."""
    target, _ = pair
    controls, prompt = SamplingControls(presence_penalty=2.0), PROMPTS[1]
    want = plain_greedy(target, prompt, 7, controls)
    history = prompt + want[:6]
    ver = SequenceVerifier(target, None, capacity=40, controls=controls)
    assert ver.open(history, prompt_len=len(prompt))[0] == want[6]
    as_prompt = SequenceVerifier(target, None, capacity=40, controls=controls).open(history)[0]
    assert as_prompt != want[6]
    with pytest.raises(ValueError, match="prompt_len"):
        SequenceVerifier(target, None, capacity=40, controls=controls).open(history, prompt_len=len(history) + 1)
