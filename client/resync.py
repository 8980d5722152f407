"""The edge session's OFFLINE and RESYNCING states, and a chat's next turn, which the server takes in the same way.

A part of tether.client.session.EdgeSession (a mixin over its state: prompt, tokens, tags, verified, the drafter
behind its delta gate, the stub and the stream); docs/ARCHITECTURE.md, section 7.
- OFFLINE (`_offline_step`): the drafter goes on alone, one token a step, from the last token of the text, by the
  sampling controls' processed rule (its greedy text under penalties is the processed one). Tokens
  the drafter has not seen yet (a new turn's, or those after a resync the link broke halfway) are fed to it first.
- RESYNCING (`_resync`): Resync from the verified length: the root (the target's last token) and the tokens
  produced since, in pieces; policy `keep` absorbs them, `rewind` keeps those before the first disagreement and
  retracts the rest. Each piece's kept tokens are tagged verified as its reply is committed (EdgeSession._verify:
  Event "verify"), so no kept token stays tagged offline, whichever way the resync ends. A server that lost the
  session rebuilds it from the full history (REASON_HISTORY_REQUIRED), and so does one whose session is full
  (REASON_SESSION_FULL: the client forgets it and sends the history).
  Then a new stream attaches and rounds go on.
- A turn (`extend(prompt)`, for a chat): the whole conversation, rendered and encoded, becomes the next run()'s
  prompt. When the session's text up to its verified length is a prefix of it, and it fits the drafter's caches,
  the held server session is kept: run() resyncs only the new tokens in, absorbed whatever the policy (they are
  the user's, not the drafter's), and generates after them; offline, the drafter reads them and answers alone.
  Otherwise, and always under a penalty (which counts a fresh session's whole conversation as its prompt, and would
  count tokens absorbed as generated), the server session is closed and run() opens a new one over the whole
  prompt (Stats.reopened). Either way the session then holds exactly `prompt`: a greedy reply is what a fresh
  session over it would give.

Tests: tests/e2e/test_chaos.py (outages, rewind, lost sessions), tests/e2e/test_chat_e2e.py (turns: one server
session, replies equal to fresh sessions', a server gone between turns), tests/client/test_chat.py.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from tether.client.delta_gate import wire_delta
from tether.client.errors import Problem
from tether.client.logprobs import drafter_logprobs
from tether.client.refusals import Refusal
from tether.client.rounds import lookahead_rows
from tether.client.session_types import CODECS, Event, State, Stats
from tether.client.transport import ServerError, rpc_error
from tether.v1 import tether_pb2 as pb


class Resync:
    """EdgeSession's offline, resync and turn methods (see the module docstring)."""

    # ---- a chat's turn -----------------------------------------------------------------------------------

    def extend(self, prompt: list[int]) -> bool:
        """Make `prompt` (the conversation so far) the next run()'s prompt; True when the held server session is
        extended, False when run() opens a new one. ValueError when it does not fit the model's context."""
        if self.models is None:
            raise RuntimeError("extend() continues a session that has run")
        if len(prompt) + 1 >= self.max_positions:
            raise ValueError(f"the conversation ({len(prompt)} tokens) no longer fits the model's context of "
                             f"{self.max_positions} tokens")  # fmt: skip
        V = self.verified
        room = len(prompt) + self.cfg.max_new_tokens + lookahead_rows(self.cfg) <= self.capacity
        # Under a penalty the server would count the new turn's tokens, absorbed, as generated, where a fresh
        # session over the conversation counts it all as the prompt (as vLLM does): a new session then.
        kept = room and 0 < V < len(prompt) and prompt[:V] == self.sequence[:V] and not self.controls.penalised
        self._stopping.clear()
        self._absorb_to = 0
        self.stats = Stats(reopened=int(not kept))
        self.prompt, self.tokens, self.tags = list(prompt), [], []
        self.offline_run = 0
        self.meter.stream_barred_until = 0  # counted in this generation's tokens (tether.client.adaptive)
        if kept:
            self._drop_rounds()
            self._feed_from = V  # the drafter holds the verified positions; offline it reads the rest first
            self._turn = True
        else:
            self._forget_session()
            self.verified = self.round = 0
        self._set_state(State.CONNECTING)
        self._t_prompt = self.started_at = time.monotonic()  # this turn's time to first token
        return kept

    def _forget_session(self) -> None:
        """Close the server session (best effort: unreachable, it expires) and drop its stream and id."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.session_id:
            try:
                self.stub.Close(pb.CloseRequest(session_id=self.session_id), metadata=self.metadata, timeout=2.0)
            except grpc.RpcError:
                pass  # the server evicts the idle session in time
        self.session_id = self.resume_token = ""

    # ---- offline -------------------------------------------------------------------------------------------

    def _offline_step(self) -> None:
        if self.cfg.max_offline_tokens and self.offline_run >= self.cfg.max_offline_tokens:
            time.sleep(0.05)  # hold the text; keep trying to reconnect
            return
        if self._feed_from is not None:
            # Tokens after the drafter's verified positions that it has not stepped over yet: a new turn's prompt,
            # or the tail a resync broken halfway left. Greedy steps, so no random draw is spent on them.
            self.drafter.feed(self.sequence[self._feed_from : -1])
            self._feed_from = None
        # The sampling controls as online: the drafter's processed greedy (or sampled) token after the text.
        seen: list[np.ndarray] = []  # its logits [V], when logprobs are reported: the target never scores it
        tokens, _, _ = self.drafter.draft(self.sequence[-1], 1, temperature=self.cfg.temperature,
                                          top_p=self.cfg.top_p, top_k=self.cfg.top_k, generator=self._draft_rng,
                                          min_p=self.cfg.min_p, processing=self._processing(self.sequence),
                                          logits_seen=None if self.logprobs is None else seen.append)  # fmt: skip
        self.offline_run += 1
        self.stats.offline_tokens += 1
        reported = None if self.logprobs is None else [drafter_logprobs(seen[0], tokens[0], self.logprobs, self.cfg)]
        self._emit(tokens, "offline", reported)

    # ---- resync --------------------------------------------------------------------------------------------

    def _resync(self, quiet: bool = False) -> None:
        """Resync from the verified length, then attach a new stream. `quiet`: no outage to tell or count (a switch
        from streaming catching the drafter up: tether.client.adaptive), as for a new turn's tokens going in. The
        offline tokens go in pieces of at most `resync_piece_tokens` (a reply carries the KV delta of what it
        absorbed, ~1 KB a token), halved while the server says a reply would pass its message limit; each piece
        starts where the server's verified length now ends. Under rewind a piece that disagrees with the target,
        inside or at its first token (the target's token after the piece before), ends the resync there: exactly
        what one Resync of all of them would keep. A turn's prompt tokens go in pieces of their own, always absorbed
        (they are the user's), as does the text a restored session had verified."""
        turn = quiet or self.state == State.CONNECTING  # no outage to report
        if not turn:
            self._set_state(State.RESYNCING)
        t0 = time.monotonic()
        rebuilt = False
        size = max(1, self.cfg.resync_piece_tokens)
        while True:
            offline = self.sequence[self.verified :]  # the root (the target's last token) first, then our drafts
            piece = offline[: min(size, self._absorb_end() - self.verified)] if self._absorbing() else offline[:size]
            try:
                reply = self._resync_piece(piece)
            except ServerError as e:
                if e.reason != pb.REASON_REPLY_TOO_LARGE or len(piece) == 1:
                    raise
                size = len(piece) // 2  # the reply would pass the server's message limit: halve and retry
                continue
            rebuilt |= reply.rebuilt
            kept = len(reply.delta.tokens)
            rest = offline[len(piece) :]
            judged = self.cfg.policy == "rewind" and not self._absorbing()  # the next token is one to judge
            disagrees = kept < len(piece) or (judged and rest and rest[0] != reply.target_token)
            if rest and not disagrees:
                continue
            if kept < len(offline):  # rewind: retract what the target would not have written
                n = len(offline) - kept
                del self.tokens[len(self.tokens) - n :]
                del self.tags[len(self.tags) - n :]
                self.stats.retracted += n
                self.on_event(Event("retract", count=n))
            break
        self._feed_from = None  # the drafter holds the verified positions; the root, after them, is its next step
        self.offline_run = 0
        self.stats.resyncs += int(not turn)
        self.stats.rebuilt += int(rebuilt)
        # The target's next token is decided now, whatever happens to the link next: were the attach to fail and
        # the client draft on from the last absorbed token instead, the next resync would hand the server a
        # drafted token as its own root (under rewind, a token the target never chose kept in the text).
        self._emit([reply.target_token], "verified", self._reported(_target_logprob(reply), [reply.target_token]))
        self._attach()
        self.round = 0
        if not turn:
            self.stats.resync_s.append(time.monotonic() - t0)
        self._set_state(State.ONLINE, "session rebuilt" if rebuilt else "")

    def _absorb_end(self) -> int:
        """Where the tokens a resync absorbs whatever the policy end: a turn's prompt, and the text a restored
        session had verified with its root (tether.client.session._restore)."""
        return max(len(self.prompt), self._absorb_to)

    def _absorbing(self) -> bool:
        """Whether the next position to resync holds a token to absorb (a turn's or the verified text), not one
        to judge."""
        return self.verified < self._absorb_end()

    def _resync_piece(self, piece: list[int]) -> pb.ResyncReply:
        """One Resync call absorbing `piece` (the server's last token first); on a lost session it is sent again
        with the whole verified history. Commits the reply's delta."""
        cfg = self.cfg
        V = self.verified
        rewind = cfg.policy == "rewind" and not self._absorbing()
        req = pb.ResyncRequest(session_id=self.session_id, resume_token=self.resume_token, verified_length=V,
                               offline_tokens=piece, sampling=self._sampling(), delta_codec=CODECS[cfg.codec],
                               model_fingerprint=self.info.model_fingerprint, rewind=rewind)  # fmt: skip
        try:
            reply = self.stub.Resync(req, metadata=self.metadata, timeout=cfg.connect_timeout_s)
        except grpc.RpcError as e:
            reason = Refusal.of_rpc_error(e).reason
            if reason == pb.REASON_SESSION_FULL:
                self._forget_session()  # no room left in it: a new session over the history takes the piece
                req.session_id = req.resume_token = ""
            elif reason != pb.REASON_HISTORY_REQUIRED:
                raise rpc_error(e) from None
            req.history.extend(self.sequence[:V])  # the server lost the session: it rebuilds from the whole history
            if self.info.sampling_controls:  # the penalties count the generated tokens of the history only
                req.prompt_length = min(len(self.prompt), V)
            self.stats.bytes_up += 4 * V
            try:
                reply = self.stub.Resync(req, metadata=self.metadata, timeout=cfg.connect_timeout_s)
            except grpc.RpcError as e2:
                raise rpc_error(e2) from None
        self.stats.bytes_up += 4 * len(piece)
        self.stats.resync_bytes.append((4 * len(piece) + (4 * V if len(req.history) else 0), len(reply.delta.payload)))
        self._count_down(reply.delta)
        self._check_resync_reply(reply, V, piece, rewind)
        self.session_id, self.resume_token = reply.session_id, reply.resume_token  # a rebuilt session has a new id
        self.drafter.commit(wire_delta(reply.delta))
        self.verified = reply.verified_length
        self._verify(V, self.verified)  # the offline tokens it kept are verified now: tagged so, and told
        self._feed_from = self.verified  # the drafter now holds exactly the verified positions: offline, it reads on
        return reply

    def _check_resync_reply(self, reply: pb.ResyncReply, V: int, piece: list[int], rewind: bool) -> None:
        """A reply this resync can take, else a lost call (BadMessage): it absorbs a prefix of the piece, all of it
        unless asked to rewind (keep never retracts), from the client's verified length, and names a next token in
        the vocabulary and ids of the server's shape. The delta itself is the drafter's gate's to check."""
        kept = list(reply.delta.tokens)
        if not 1 <= len(kept) <= len(piece) or kept != piece[: len(kept)]:
            raise self._bad_message(Problem.DELTA, "a resync reply absorbed tokens that were not the piece sent")
        if not rewind and len(kept) != len(piece):
            raise self._bad_message(Problem.DELTA, "a resync under keep dropped offline tokens")
        if reply.delta.start != V or reply.verified_length != V + len(kept):
            raise self._bad_message(Problem.DELTA, f"a resync reply from {V} claims {reply.verified_length} positions")
        self._check_ids(reply.session_id, reply.resume_token)
        self._check_token(reply.target_token, "next token")
        self._reported(_target_logprob(reply), [reply.target_token])  # checked before the reply is taken

    def _attach(self) -> None:
        self._new_stream()
        att = pb.AttachSession(session_id=self.session_id, resume_token=self.resume_token)
        reply = self.stream.request(pb.ClientMessage(attach=att), self.cfg.connect_timeout_s)
        if reply.attached.verified_length != self.verified:
            raise ServerError(grpc.StatusCode.INTERNAL, "the server's verified length differs after resync")


def _target_logprob(reply: pb.ResyncReply) -> list[pb.TokenLogprob]:
    """The reply's logprob entry of its next token, as a list (none from a server not asked, or older)."""
    return [reply.target_logprob] if reply.HasField("target_logprob") else []
