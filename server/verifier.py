"""The server half of speculative decoding for one sequence: prefill, then verify a draft tree per round.

Contract: `SequenceVerifier(target, drafter, capacity=..., temperature=..., top_p=..., top_k=..., generator=...)`,
or `controls=SamplingControls(...)` for the whole rule (min_p, penalties, logit_bias; tether.shared.logits_processing).
`open(prompt)` prefills the target's KV cache (in chunks of `prefill_chunk` positions) and returns the target's
first token and the drafter's delta for the prompt positions. `verify(tree)` runs root + drafts through the target
in one forward (tree mask, tree positions), decides the verdict (greedy or lossless rejection sampling,
tether.shared.speculative.verify), commits the accepted path to the cache and returns the verdict and the delta for
the newly verified positions (root + accepted drafts): it is tether.server.rounds.verify_batch of one row, the one
verify path. `absorb(verified, offline, rewind=...)` is a resync's forward beside it, and `decode(root, n)` plain
decoding (verify rounds with empty drafts, chained on the device when greedy). The verifier never looks at
who drafted: any DraftTree will do. It is what the in-process engine runs, and what each gRPC session runs; with
drafter None no delta is produced. With `pool` the sequence's KV lives in the server's paged pool
(tether.server.kv_pool) instead of a contiguous cache; `cache` hands it a pool sequence someone else owns.

With `logprobs=N` every token the sequence emits (the first, each round's accepted drafts and bonus, a resync's next
token) is reported in `reported` with the log-probabilities of its position's processed distribution, its own and
the N most probable (tether.shared.sampling.token_logprobs): the HTTP API's logprobs.

Penalties count the sequence's tokens, so the verifier keeps them by position (`tokens`: the prompt, then every
committed token; whoever commits rows calls `record`). A round's root sits at position `length`, so the context
of its tree is tokens[:length] + [root] (`processing_at(root)`), however the cache was truncated before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tether.server.kv_pool import KVPool
from tether.server.rounds import decode_runner, forward_rows, gather_deltas, verify_batch
from tether.shared.contracts import ForwardOutput, SequenceCache, ServerDrafter, Target
from tether.shared.drafter import DraftDelta, TargetStates
from tether.shared.logits_processing import LogitsProcessing, SamplingControls
from tether.shared.sampling import TokenLogprobs, sample_token, token_logprobs
from tether.shared.speculative import DraftTree, Verdict

DECODE_CHUNK = 16  # tokens plain decoding hands back at a time to stream them (one replay of chained steps on a GPU)


class Stopped(Exception):
    """`open` was told to stop between prefill chunks: the sequence holds a partial prompt and is of no use."""


def target_states(out: ForwardOutput) -> TargetStates:
    """The batch-1 forward's states for all its new positions."""
    return TargetStates(k=out.k[:, 0], v=out.v[:, 0], hidden=out.hidden[0][0])


class SequenceVerifier:
    def __init__(
        self,
        target: Target,
        drafter: ServerDrafter | None = None,
        *,
        capacity: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        pool: KVPool | None = None,
        prefill_chunk: int = 2048,
        cache: SequenceCache | None = None,
        controls: SamplingControls | None = None,
        logprobs: int | None = None,
    ):
        self.target = target
        self.drafter = drafter  # only its server part (server_delta, i.e. LSA for MoA) is used here
        if controls is None:
            controls = SamplingControls(temperature, top_p, top_k)
        elif (temperature, top_p, top_k) != (0.0, 1.0, 0):
            raise TypeError("give the sampling rule as controls or as temperature / top_p / top_k, not both")
        controls.check_vocab(target.cfg.vocab_size)
        self.controls, self.generator = controls, generator
        self.logprobs = logprobs  # report this many most probable tokens per emitted token (None: report nothing)
        self.reported: list[TokenLogprobs] = []  # one per emitted token, in order, with `logprobs`
        self.tokens: list[int] = []  # the sequence by position: the prompt, then the committed tokens
        self.prompt_len = 0
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk  # prompt positions per prefill forward
        capacity = min(capacity, target.cfg.max_seq_len)
        self.cache: SequenceCache
        if cache is not None:  # lent by the session table, which gives it back
            self.cache = cache
        else:
            self.cache = target.new_cache(1, capacity) if pool is None else pool.sequence(capacity)

    @property
    def length(self) -> int:
        """Verified positions held in the KV cache."""
        return self.cache.length

    def record(self, start: int, tokens: list[int]) -> None:
        """Rows from `start` on now hold `tokens` (committed to the cache): what later positions' penalties count."""
        del self.tokens[start:]
        self.tokens += tokens

    def processing_at(self, root: int) -> LogitsProcessing | None:
        """The logit_bias and penalties of the position after `root` (the round's root, at position `length`)."""
        if not self.controls.processes_logits:
            return None
        context = self.tokens[: self.cache.length] + [root]
        return self.controls.processing(context, self.prompt_len, self.target.cfg.vocab_size)

    def report(self, logits: torch.Tensor, tree: DraftTree, verdict: Verdict) -> None:
        """With `logprobs`: the emitted tokens of a round whose forward gave `logits` [T, V] (node j's row j; emitted
        token m was drawn at node path[m], after the accepted tokens before it)."""
        if self.logprobs is None:
            return
        rows = logits[verdict.path].float().cpu().numpy()  # [tau, V]
        base = self.processing_at(tree._tokens[0])
        emitted = verdict.emitted_tokens(tree)
        for m, token in enumerate(emitted):
            self._report(rows[m] if base is None else base.after(emitted[:m]).apply_np(rows[m]), token)

    def _report(self, logits, token: int) -> None:
        c = self.controls
        self.reported.append(token_logprobs(logits, token, self.logprobs, c.temperature, c.top_p, c.top_k, c.min_p))

    def reserve(self, n: int) -> None:
        """Make sure the next forward can write n rows (ValueError when the sequence is full; a paged cache
        takes its blocks now and raises PoolExhausted when the pool cannot give them)."""
        if n > self.room:
            raise ValueError(f"a tree of {n} nodes does not fit the {self.room} positions left")
        self.cache.reserve(n)

    def release(self) -> None:
        """Give the KV memory back (a paged cache returns its blocks to the pool)."""
        self.cache.release()

    @property
    def room(self) -> int:
        """Tree nodes (root included) the cache can take in the next round."""
        return self.cache.capacity - self.cache.length

    def sample(self, logits: torch.Tensor, processing: LogitsProcessing | None = None) -> int:
        """The target's next token from logits [V] under this sequence's sampling settings and generator, the logits
        processed with `processing` (the position's, from processing_at) when given."""
        if processing is not None:
            logits = torch.from_numpy(processing.apply_np(logits.float().cpu().numpy()))
        c = self.controls
        return sample_token(
            logits, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, min_p=c.min_p, generator=self.generator
        )

    @torch.inference_mode()
    def open(
        self, prompt_ids: list[int], stop: Callable[[], bool] | None = None, *, prompt_len: int | None = None
    ) -> tuple[int, DraftDelta | None]:
        """Prefill; `stop` (its caller has gone) is asked before each chunk, and Stopped raised when it says so.
        `prompt_len`: of these tokens, how many are the prompt (the rest were generated, as in a resync's history;
        the frequency and presence penalties count those); None: all of them."""
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        if len(prompt_ids) >= self.cache.capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in a {self.cache.capacity} cache")
        prompt = torch.tensor([prompt_ids], device=self.target.device)
        if prompt_len is not None and not 0 <= prompt_len <= len(prompt_ids):
            raise ValueError(f"prompt_len must be in [0, {len(prompt_ids)}], got {prompt_len}")
        self.prompt_len = self.cache.length + (len(prompt_ids) if prompt_len is None else prompt_len)
        self.record(self.cache.length, list(prompt_ids))
        want = self.drafter is not None
        # In chunks, each against the cache so far: attention memory grows with chunk x prompt, not prompt^2
        # (the reference path on a long resync history), and only the last position's logits are computed.
        outs = []
        for i in range(0, prompt.shape[1], self.prefill_chunk):
            if stop is not None and stop():
                raise Stopped(f"prefill stopped after {i} of {prompt.shape[1]} positions")
            outs.append(
                self.target.prefill(
                    prompt[:, i : i + self.prefill_chunk],
                    self.cache,
                    last_only=True,
                    hidden_layers=(self.target.cfg.n_layers,),
                    return_kv=want,
                )
            )
        out = (
            outs[0]
            if len(outs) == 1
            else ForwardOutput(
                logits=outs[-1].logits,
                k=torch.cat([o.k for o in outs], 2) if want else None,
                v=torch.cat([o.v for o in outs], 2) if want else None,
                hidden=(torch.cat([o.hidden[0] for o in outs], 1),),
            )
        )
        processing = None
        if self.controls.processes_logits:
            processing = self.controls.processing(self.tokens, self.prompt_len, self.target.cfg.vocab_size)
        first = self.sample(out.logits[0, -1], processing)
        if self.logprobs is not None:
            row = out.logits[0, -1].float().cpu().numpy()
            self._report(row if processing is None else processing.apply_np(row), first)
        delta = self.drafter.server_delta(target_states(out), 0, prompt_ids) if want else None
        return first, delta

    def verify(self, tree: DraftTree) -> tuple[Verdict, DraftDelta | None]:
        """One round: `verify_batch` of this sequence alone."""
        result = verify_batch(self.target, [(self, tree)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @torch.inference_mode()
    def decode(self, root: int, n: int) -> list[int]:
        """Plain decoding: the target's next n tokens after `root` (the last decided token, not yet in the cache),
        exactly what n rounds of `verify` with empty drafts give; root and all but the last token are committed.
        Greedy sequences on a step runner chain up to 16 steps per CUDA graph replay (tether.server.step)."""
        if n > self.room:
            raise ValueError(f"{n} tokens do not fit the {self.room} positions left")
        plain_greedy = self.controls.temperature == 0 and not self.controls.processes_logits and self.logprobs is None
        runner = decode_runner(self.target, self.cache) if plain_greedy else None
        out: list[int] = []
        while len(out) < n:
            if runner is not None:
                start = self.cache.length
                new = runner.decode(self.cache, root, n - len(out))
                self.record(start, [root, *new[:-1]])  # the root and all but the last are committed
                out += new
            else:
                out.append(self.verify(DraftTree.chain(root, []))[0].bonus)
            root = out[-1]
        return out

    @torch.inference_mode()
    def absorb(self, verified: int, offline: list[int], *, rewind: bool) -> tuple[int, int, DraftDelta | None]:
        """A resync: back to `verified` positions, then run the client's offline tokens through the target as one
        chain and keep all of them, or with `rewind` the prefix the target agrees with (greedily). offline[0] is the
        root, the target's own token, so at least it is kept. Returns (first disagreement, the target's next token,
        the delta of what was kept)."""
        if not offline:
            raise ValueError("a resync absorbs at least the root token")
        self.cache.truncate(verified)
        self.reserve(len(offline))
        tree = DraftTree.chain(offline[0], offline[1:])
        want = self.drafter is not None
        base = self.processing_at(offline[0])  # position i's: base after offline[1 : i + 1]
        with forward_rows(self.target, [self.cache], [tree], states=want) as (out, _):
            logits = out.logits[0, : len(offline)]  # [n, V]
            if base is None:
                greedy = logits.argmax(-1).tolist()  # greedy[i]: the target's token after offline[i]
            else:
                rows = logits.float().cpu().numpy()
                greedy = [int(base.after(offline[1 : i + 1]).apply_np(rows[i]).argmax()) for i in range(len(offline))]
            disagreement = next((i for i in range(1, len(offline)) if offline[i] != greedy[i - 1]), len(offline))
            kept = disagreement if rewind else len(offline)
            processing = None if base is None else base.after(offline[1:kept])
            next_token = self.sample(logits[kept - 1], processing)
            if self.logprobs is not None:
                row = logits[kept - 1].float().cpu().numpy()
                self._report(row if processing is None else processing.apply_np(row), next_token)
            path = list(range(kept))
            delta = gather_deltas(out, self.drafter, [(0, verified, path, offline[:kept])])[0] if want else None
        self.cache.accept(path)
        self.record(verified, offline[:kept])
        return disagreement, next_token, delta
