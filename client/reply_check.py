"""What the server sends an edge session, checked before the session takes it, and the error for what it refuses.

Contract:
- `ReplyCheck(output, vocab_size)`: `token(t, what)` refuses a token outside the vocabulary, `ids(session_id,
  resume_token)` ids not of the server's shape (32 lowercase hex digits), `logprobs(entries, tokens)` returns the
  server's logprobs of `tokens` checked (tether.client.logprobs), or None when the caller asked for none.
- `refused(problem, message)` is the error each of them raises, and what the session's other checks raise (the
  delta gate's, a verdict's, a resync reply's): counted in Stats.bad_messages; BadMessage once generating (a lost
  round: the session goes offline and resyncs, and tells the refusal as Event "info"), ServerDataError while
  connecting (nothing to draft from yet, and retrying would loop).

Tests: tests/e2e/test_hostile_deltas.py, tests/client/test_hostile_server.py, tests/client/test_round_shape.py.
"""

from __future__ import annotations

from tether.client.errors import Problem, ServerDataError
from tether.client.logprobs import server_logprobs
from tether.client.session_output import SessionOutput
from tether.client.session_types import Event, State
from tether.client.transport import BadMessage
from tether.shared.ids import is_session_id
from tether.shared.sampling import TokenLogprobs


class ReplyCheck:
    """Checks of the server's messages for one session; see the module docstring."""

    def __init__(self, output: SessionOutput, vocab_size: int):
        self.output, self.vocab_size = output, vocab_size

    def refused(self, problem: Problem, message: str) -> ServerDataError:
        self.output.stats.bad_messages += 1
        if self.output.state == State.CONNECTING:
            return ServerDataError(problem, message)
        self.output.tell(Event("info", detail=f"refused an invalid {problem.value} from the server: {message}"))
        return BadMessage(problem, message)

    def token(self, token: int, what: str) -> None:
        if not 0 <= token < self.vocab_size:
            raise self.refused(Problem.TOKEN, f"{what} {token} is outside the vocabulary")

    def ids(self, session_id: str, resume_token: str) -> None:
        if not (is_session_id(session_id) and is_session_id(resume_token)):
            raise self.refused(Problem.SESSION_ID, "not 32 lowercase hex digits")

    def logprobs(self, entries, tokens: list[int]) -> list[TokenLogprobs] | None:
        """The server's logprobs of `tokens` (entries: pb.TokenLogprob), checked; None when none were asked."""
        if self.output.logprobs is None:
            return None
        try:
            return server_logprobs(entries, tokens, self.output.logprobs, self.vocab_size)
        except ValueError as e:
            raise self.refused(Problem.LOGPROBS, str(e)) from None
