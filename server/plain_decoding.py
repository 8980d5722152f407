"""Server-only decoding: the target decodes a prompt alone, for the Generate RPC and for the OpenAI-compatible HTTP
API (tether.server.http_api), through one loop.

Contract (`PlainDecoder`, owned by the engine, tether.server.engine_core):
- `check_generation(prompt, sampling)` checks a prompt (ids in the vocabulary, not empty, within
  max_prompt_tokens and the KV pool) and sampling values (tether.server.validation.Checks.sampling: the controls,
  stop_token_ids) before anything is allocated: RequestError otherwise.
- `decode(prompt, sampling, max_new_tokens, released=None, stop_ids=())` is an async generator of token chunks: the
  first token alone right after the prefill, then the rest as they are decided under the request's whole sampling
  rule (min_p, penalties, logit_bias: tether.shared.logits_processing), at most max_new_tokens (0: the server's
  limit) and never past the model's context; a token of `stop_ids` is the last one sent. With `logprobs` (a list)
  and `top_logprobs`, each chunk's tokens' log-probabilities (tether.shared.sampling.TokenLogprobs: the processed
  distribution each was drawn from) are appended to it (given empty) before the chunk is yielded. A stream alone
  decodes 16 chained steps per replay (tether.server.verifier.DECODE_CHUNK); while others decode, each stream's next
  token is a round of the batcher (tether.server.batcher), verified in one step with every other stream's and every
  Session's rounds. Its KV lives in the paged pool, lent by the session table (tether.server.sessions) and given
  back however the generator ends: closed by its consumer (a client went away) it gives the KV back at once, or
  when the step in flight on a model thread ends (work not yet started is dropped: tether.server.model_work);
  `released` is called then. A full pool raises RequestError(REASON_CAPACITY) with retry advice, and so does a
  caller over its share of the model threads' queue.
- `steps(ver, sampling)`: how one generation gets its tokens (PlainSteps: the target alone); server-side speculation
  (tether.server.server_draft) is this class with steps that draft, everything else the same.
- `pace` (tether.server.decode_pace.DecodePace): the seconds a token each chunk took (from asking for it to having
  it), alone and batched; `step_s()` what a new stream's tokens would take now (ModelInfo.decode_step_s).
- `stop_ids(sampling)`: the model's end-of-text ids (ModelInfo.eos_ids; none with sampling.ignore_eos, so the
  stream runs to its length) and the request's stop_token_ids. The Generate RPC (tether.server.service) streams
  `decode`'s chunks as GeneratedTokens, with their log-probabilities when asked.

Its methods run on the engine's event loop; it is given the engine's table, model threads, batcher and checks.

    async with contextlib.aclosing(engine.plain.decode(prompt, pb.SamplingParams(), 64)) as chunks:
        async for tokens in chunks:
            ...
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence

import torch

from tether.server.batcher import RoundBatcher
from tether.server.decode_pace import DecodePace
from tether.server.errors import Reason, RequestError
from tether.server.kv_pool import PoolExhausted
from tether.server.model_work import ModelWork
from tether.server.sessions import SessionTable
from tether.server.validation import Checks, invalid, sampling_controls
from tether.server.verifier import DECODE_CHUNK, SequenceVerifier
from tether.shared.contracts import ServerDrafter
from tether.shared.sampling import TokenLogprobs
from tether.shared.speculative import DraftTree, Verdict, through_stop
from tether.v1 import tether_pb2 as pb

POOL_RETRY_S = 0.5  # retry advice when the KV pool is full and nothing idle can be evicted


class PlainSteps:
    """One generation's way to its next tokens, the target deciding alone: `first` prefills, `next` decodes a chunk,
    alone (chained steps on a model thread) or as a round of the batcher beside every other stream's and Session's.
    `work` is the job in flight (a model thread's or the batcher's), whose end the KV waits for. A subclass drafts
    (tether.server.server_draft.DraftedSteps); its hooks run on a model thread (`open`, `alone`) or here, on the
    event loop (`draft`, `emitted`)."""

    def __init__(self, ver: SequenceVerifier, models: ModelWork, batcher: RoundBatcher):
        self.ver, self.models, self.batcher = ver, models, batcher
        self.work: concurrent.futures.Future | None = None  # the last job submitted for this generation

    def open(self, prompt: list[int], stop: Callable[[], bool]) -> int:
        """The prefill, on a model thread: the first token."""
        return self.ver.open(prompt, stop)[0]

    def alone(self, root: int, left: int) -> list[int]:
        """The tokens after `root` while no other generation decodes, on a model thread: up to 16 chained steps."""
        return self.ver.decode(root, min(left, DECODE_CHUNK, self.ver.room))

    async def draft(self, root: int, left: int) -> DraftTree:
        """The batcher round after `root`: no drafts, the target's next token alone."""
        return DraftTree.chain(root, [])

    def emitted(self, tree: DraftTree, verdict: Verdict, delta) -> list[int]:
        """The tokens a batcher round decided."""
        return verdict.emitted_tokens(tree)

    async def first(self, prompt: list[int]) -> int:
        self.work = self.models.submit(self.open, prompt, stoppable=True)
        return await self.models.wait(self.work)

    async def next(self, root: int, left: int, alone: bool) -> list[int]:
        """The tokens after `root` (at most `left`, the caller cuts them there), on a model thread when `alone`."""
        if alone:
            self.work = self.models.submit(self.alone, root, left)
            return await self.models.wait(self.work)
        tree = await self.draft(root, left)
        self.work, here = self.batcher.submit_here(self.ver, tree)
        verdict, delta = await self.models.wait(self.work, None, here)
        return self.emitted(tree, verdict, delta)


class PlainDecoder:
    """Generate's and the HTTP API's decoding (see the module docstring)."""

    def __init__(
        self,
        target,
        config,
        table: SessionTable,
        work: ModelWork,
        batcher: RoundBatcher,
        check: Checks,
        eos_ids: tuple[int, ...],
    ):
        self.target, self.config, self.table, self.work, self.batcher, self.check = (
            target,
            config,
            table,
            work,
            batcher,
            check,
        )
        self.eos_ids = eos_ids  # every end-of-text id of the model
        self.generating = 0  # server-only generations decoding now (event loop only: no lock)
        self.pace = DecodePace()  # what each chunk's tokens took, alone and batched
        self.server_part: ServerDrafter | None = None  # the drafter part the verifier makes deltas with (none here)

    def steps(self, ver: SequenceVerifier, sampling: pb.SamplingParams) -> PlainSteps:
        """How one generation over `ver` gets its tokens: the target alone."""
        return PlainSteps(ver, self.work, self.batcher)

    def step_s(self) -> float:
        """Seconds a token a stream started now would take (ModelInfo.decode_step_s; 0.0: none measured yet)."""
        return self.pace.step_s(together=self.generating > 0)

    def check_generation(self, prompt: Sequence[int], sampling: pb.SamplingParams) -> list[int]:
        """A server-only generation's prompt and sampling, checked before anything is allocated (Generate and the
        HTTP API): the prompt as a list, or a RequestError (INVALID_REQUEST, TOO_LONG)."""
        ids = self.check.tokens(prompt, "prompt", self.config.max_prompt_tokens)
        if not ids:
            raise invalid("empty prompt")
        self.check.sampling(sampling)
        self.check.fits_pool(len(ids), "prompt")
        return ids

    def stop_ids(self, sampling: pb.SamplingParams) -> frozenset[int]:
        """The ids that end a generation: the request's stop tokens, and the end-of-text ids unless it ignores them."""
        return frozenset(() if sampling.ignore_eos else self.eos_ids) | frozenset(sampling.stop_token_ids)

    async def decode(
        self,
        prompt: list[int],
        sampling: pb.SamplingParams,
        max_new_tokens: int = 0,
        *,
        released: Callable[[], None] | None = None,
        stop_ids: Collection[int] = (),
        logprobs: list[TokenLogprobs] | None = None,
        top_logprobs: int = 0,
    ) -> AsyncIterator[list[int]]:
        """Server-only decoding of a checked prompt and sampling (`check_generation`): the target's tokens in chunks
        as they are decided, the first one alone right after the prefill; `max_new_tokens` (0: the server's limit) at
        most, ending after the first token of `stop_ids` (the caller's end-of-text ids and stop tokens; empty: only
        the length ends it). RequestError(REASON_CAPACITY) when the KV pool is full.
        Closing the generator ends the generation at once; its KV goes back when the step in flight (if any) has
        finished, and then `released` is called (on whichever thread that is)."""
        n = min(self.config.max_new(max_new_tokens), self.target.cfg.max_seq_len - len(prompt))
        generator = torch.Generator().manual_seed(sampling.seed)
        # Through the paged pool (and so through a tensor-parallel target too), given back when the stream ends.
        cache = self.table.lend(len(prompt) + n)
        ver = SequenceVerifier(
            self.target,
            self.server_part,
            capacity=cache.capacity,
            controls=sampling_controls(sampling),
            generator=generator,
            cache=cache,
            logprobs=None if logprobs is None else top_logprobs,
        )

        def reported(chunk: list[int]) -> list[int]:
            if logprobs is not None:  # the verifier reported every token decided, the chunk's first
                logprobs.extend(ver.reported[len(logprobs) : len(logprobs) + len(chunk)])
            return chunk

        stop = frozenset(stop_ids)

        def give_back(_=None) -> None:
            self.table.give_back(cache)
            if released is not None:
                released()

        # A stream alone decodes on a model thread (16 chained steps per replay); with others, each stream's next
        # tokens are a round of the batcher, verified in one step with every other stream's and every Session's rounds.
        self.generating += 1
        steps = self.steps(ver, sampling)
        try:
            token = await steps.first(prompt)
            yield reported([token])
            left = 0 if token in stop else n - 1
            while left > 0 and ver.room > 0:
                alone, t0 = self.generating == 1, time.perf_counter()
                chunk = await steps.next(token, left, alone=alone)
                self.pace.decoded(time.perf_counter() - t0, len(chunk), alone=alone)
                chunk = through_stop(chunk, stop)[:left]  # the tokens decided after a stop token are dropped
                token, left = chunk[-1], 0 if chunk[-1] in stop else left - len(chunk)
                yield reported(chunk)
        except PoolExhausted:
            raise RequestError(Reason.REASON_CAPACITY, "the KV pool is full; try again shortly", POOL_RETRY_S) from None
        finally:
            self.generating -= 1
            work = steps.work
            if work is None or work.done():
                give_back()
            else:  # still running on a thread: the cache goes back when it is done with it
                work.add_done_callback(give_back)
