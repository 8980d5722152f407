"""Reported log-probabilities on the wire: tether.shared.sampling.TokenLogprobs as the proto's TokenLogprob, which
Opened.first_logprob, Verdict.logprobs and GeneratedTokens.logprobs carry when SamplingParams.logprobs asks
(tether.server.validation.requested_logprobs bounds it at 20 top tokens, so an entry is at most 21 pairs).

    pb.GeneratedTokens(tokens=chunk, logprobs=wire_logprobs(entries))
    pb.Verdict(..., logprobs=taken_logprobs(session.verifier, verdict.accepted + 1))  # and clears its reports
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from tether.shared.sampling import TokenLogprobs
from tether.v1 import tether_pb2 as pb


class ReportingVerifier(Protocol):
    reported: list[TokenLogprobs]  # tether.server.verifier.SequenceVerifier's, one per emitted token


def wire_logprob(e: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token=e.token, logprob=e.logprob, top_ids=[t for t, _ in e.top], top_logprobs=[v for _, v in e.top]
    )


def wire_logprobs(entries: Iterable[TokenLogprobs]) -> list[pb.TokenLogprob]:
    return [wire_logprob(e) for e in entries]


def taken_logprobs(verifier: ReportingVerifier, n: int) -> list[pb.TokenLogprob]:
    """The last `n` entries a session's verifier reported (a round's emitted tokens, or the first token), on the
    wire; the rest are dropped (a rebuild's), so what a long session holds stays one round's worth."""
    entries = verifier.reported[-n:] if verifier.reported else []
    verifier.reported.clear()
    return wire_logprobs(entries)
