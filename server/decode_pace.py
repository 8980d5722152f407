"""What a token of a Generate stream costs on this server now: ModelInfo.decode_step_s, which every GetModelInfo
answers fresh so that an edge client can predict a stream it has not tried (tether.client.mode_choice) better
than from its verdicts' waits, which hold a verify round of its own draft (on a CPU several decode steps) and say
nothing of whether the server is busy.

Contract (`DecodePace`, owned by tether.server.plain_decoding.PlainDecoder, used on the event loop only):
- `decoded(seconds, tokens, alone=)`: a stream's chunk of `tokens` tokens came `seconds` after it was asked for:
  a lone stream's chained steps on a model thread (`alone`), or the batcher's step its round waited for and ran in
  beside every other stream's and session's (queueing included: what a stream gets).
- `step_s(together=)`: the seconds a token a new stream would get: the batched figure when it would decode beside
  others (`together`: a stream decodes now; the lone figure while none was batched yet), the lone figure when it
  would decode alone. Each figure is an EWMA (weight EWMA_WEIGHT for the newest chunk) of the seconds per token of
  the chunks measured so; 0.0 before any (a client then predicts from its own figures). Kept apart, so a server
  that was busy does not advertise its busy figure once idle, when a new stream decodes alone.

    pace = DecodePace()
    pace.decoded(0.2, 16, alone=True)
    pace.step_s(together=False)  # 0.0125

Tests: tests/server/test_decode_pace.py.
"""

from __future__ import annotations

EWMA_WEIGHT = 0.25  # weight of the newest chunk's seconds per token


class DecodePace:
    """Seconds per token of the server's Generate streams, alone and batched (see the module docstring)."""

    def __init__(self) -> None:
        self.alone_s = 0.0  # EWMA of a lone stream's seconds per token; 0.0: none measured
        self.together_s = 0.0  # EWMA of a batched stream's seconds per token; 0.0: none measured

    def decoded(self, seconds: float, tokens: int, *, alone: bool) -> None:
        if tokens <= 0:
            return
        per = max(seconds, 0.0) / tokens
        last = self.alone_s if alone else self.together_s
        figure = per if last == 0.0 else last + EWMA_WEIGHT * (per - last)
        if alone:
            self.alone_s = figure
        else:
            self.together_s = figure

    def step_s(self, *, together: bool) -> float:
        return (self.together_s or self.alone_s) if together else self.alone_s
