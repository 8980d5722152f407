"""The edge session's OFFLINE and RESYNCING states: the drafter writing alone, and the text brought back in step
with the server, as after an outage so for a chat's next turn.

`Resync` is an object EdgeSession (tether.client.session) composes: it holds the session's text (SessionText: the
resync advances its verified length and retracts what rewind does not keep), the server link, the output it emits
to, the drafter behind its delta gate, and the rounds (whose numbering a new stream restarts); docs/ARCHITECTURE.md,
section 7.
- OFFLINE (`offline_step`): the drafter goes on alone, one token a step, from the last token of the text, by the
  sampling controls' processed rule (its greedy text under penalties is the processed one). Tokens the drafter has
  not seen yet (a new turn's, a stream's, or those after a resync the link broke halfway: `behind(position)` says
  where they start) are fed to it first.
- RESYNCING (`resync`): Resync from the verified length: the root (the target's last token) and the tokens
  produced since, in pieces; policy `keep` absorbs them, `rewind` keeps those before the first disagreement and
  retracts the rest. Each piece's kept tokens are tagged verified as its reply is committed (SessionText.verify,
  told as Event "verify"), so no kept token stays tagged offline, whichever way the resync ends. A server that lost
  the session rebuilds it from the full history (REASON_HISTORY_REQUIRED), and so does one whose session is full
  (REASON_SESSION_FULL: the client forgets it and sends the history). Then a new stream attaches and rounds go on.
- Tokens a resync absorbs whatever the policy, being the user's or the target's (`absorb_through(position)`): a
  turn's prompt, the tokens a stream brought (tether.client.adaptive), the text a restored session had verified.
- A chat's turn (EdgeSession.extend): when the held server session is kept, `new_turn(verified)` leaves the drafter
  the verified positions it holds; run() resyncs the new tokens in (absorbed) and generates after them; offline,
  the drafter reads them and answers alone.

Tests: tests/e2e/test_chaos.py (outages, rewind, lost sessions), tests/e2e/test_chat_e2e.py (turns: one server
session, replies equal to fresh sessions', a server gone between turns), tests/client/test_chat.py.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import numpy as np

from tether.client.controls import sampling_params
from tether.client.delta_gate import DeltaGate, wire_delta
from tether.client.errors import Problem
from tether.client.logprobs import drafter_logprobs
from tether.client.refusals import Refusal
from tether.client.reply_check import ReplyCheck
from tether.client.rounds import Rounds
from tether.client.server_link import ServerLink
from tether.client.session_output import SessionOutput
from tether.client.session_text import SessionText
from tether.client.session_types import ClientConfig, Event, State, codec_fields
from tether.client.transport import ServerError, rpc_error
from tether.shared.logits_processing import SamplingControls
from tether.v1 import tether_pb2 as pb


class Resync:
    """The session's offline steps and resyncs over its text, link and output (see the module docstring)."""

    def __init__(
        self,
        cfg: ClientConfig,
        text: SessionText,
        link: ServerLink,
        output: SessionOutput,
        check: ReplyCheck,
        drafter: DeltaGate,
        rounds: Rounds,
        *,
        controls: SamplingControls,
        rng: Any,
    ):
        """rng: the random stream offline tokens are sampled from."""
        self.cfg, self.text, self.link, self.output, self.check = cfg, text, link, output, check
        self.drafter, self.rounds, self.controls, self.rng = drafter, rounds, controls, rng
        self.offline_run = 0  # tokens written alone in this outage
        self._feed_from: int | None = None  # offline, the drafter first reads the text from here (behind())
        self._absorb_to = 0  # a resync absorbs the text up to here whatever the policy (absorb_through())

    # ---- what the drafter holds, and what a resync absorbs --------------------------------------------------

    def behind(self, position: int | None) -> None:
        """The drafter holds the text's states up to `position` only (None: all but the last token, which it steps
        from): offline, it reads the rest first."""
        self._feed_from = position

    def absorb_through(self, position: int) -> None:
        """The text up to `position` is the user's or the target's: a resync absorbs it whatever the policy."""
        self._absorb_to = max(self._absorb_to, position)

    def new_turn(self, verified: int | None) -> None:
        """A chat's next turn: over a held session whose `verified` positions the drafter holds, or (None) one to
        be opened anew."""
        self._absorb_to = self.offline_run = 0
        self._feed_from = verified

    def _absorb_end(self) -> int:
        """Where the tokens a resync absorbs whatever the policy end: a turn's prompt, and what absorb_through()
        said (a stream's tokens, the text a restored session had verified)."""
        return max(len(self.text.prompt), self._absorb_to)

    def _absorbing(self) -> bool:
        """Whether the next position to resync holds a token to absorb (a turn's or the verified text), not one
        to judge."""
        return self.text.verified < self._absorb_end()

    # ---- offline -------------------------------------------------------------------------------------------

    def offline_step(self) -> None:
        cfg, text = self.cfg, self.text
        if cfg.max_offline_tokens and self.offline_run >= cfg.max_offline_tokens:
            time.sleep(0.05)  # hold the text; keep trying to reconnect
            return
        if self._feed_from is not None:
            # Tokens after the drafter's verified positions that it has not stepped over yet: a new turn's prompt,
            # or the tail a resync broken halfway left. Greedy steps, so no random draw is spent on them.
            self.drafter.feed(text.sequence[self._feed_from : -1])
            self._feed_from = None
        # The sampling controls as online: the drafter's processed greedy (or sampled) token after the text.
        logprobs = self.output.logprobs
        seen: list[np.ndarray] = []  # its logits [V], when logprobs are reported: the target never scores it
        processing = self.controls.processing(text.sequence, len(text.prompt), self.check.vocab_size)
        tokens, _, _ = self.drafter.draft(
            text.sequence[-1],
            1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            generator=self.rng,
            min_p=cfg.min_p,
            processing=processing,
            logits_seen=None if logprobs is None else seen.append,
        )
        self.offline_run += 1
        self.output.stats.offline_tokens += 1
        reported = None if logprobs is None else [drafter_logprobs(seen[0], tokens[0], logprobs, cfg)]
        self.output.emit(tokens, "offline", reported)

    # ---- resync --------------------------------------------------------------------------------------------

    def resync(self, quiet: bool = False) -> None:
        """Resync from the verified length, then attach a new stream. `quiet`: no outage to tell or count (a switch
        from streaming catching the drafter up: tether.client.adaptive), as for a new turn's tokens going in. The
        offline tokens go in pieces of at most `resync_piece_tokens` (a reply carries the KV delta of what it
        absorbed, ~1 KB a token), halved while the server says a reply would pass its message limit; each piece
        starts where the server's verified length now ends. Under rewind a piece that disagrees with the target,
        inside or at its first token (the target's token after the piece before), ends the resync there: exactly
        what one Resync of all of them would keep. A turn's prompt tokens go in pieces of their own, always absorbed
        (they are the user's), as does the text a restored session had verified."""
        output, text = self.output, self.text
        turn = quiet or output.state == State.CONNECTING  # no outage to report
        if not turn:
            output.set_state(State.RESYNCING)
        t0 = time.monotonic()
        rebuilt = False
        size = max(1, self.cfg.resync_piece_tokens)
        while True:
            offline = text.sequence[text.verified :]  # the root (the target's last token) first, then our drafts
            piece = offline[: min(size, self._absorb_end() - text.verified)] if self._absorbing() else offline[:size]
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
                text.retract(n)
                output.stats.retracted += n
                output.tell(Event("retract", count=n))
            break
        self._feed_from = None  # the drafter holds the verified positions; the root, after them, is its next step
        self.offline_run = 0
        output.stats.resyncs += int(not turn)
        output.stats.rebuilt += int(rebuilt)
        # The target's next token is decided now, whatever happens to the link next: were the attach to fail and
        # the client draft on from the last absorbed token instead, the next resync would hand the server a
        # drafted token as its own root (under rewind, a token the target never chose kept in the text).
        target = [reply.target_token]
        output.emit(target, "verified", self.check.logprobs(_target_logprob(reply), target))
        self.attach()
        self.rounds.restart()
        if not turn:
            output.stats.resync_s.append(time.monotonic() - t0)
        output.set_state(State.ONLINE, "session rebuilt" if rebuilt else "")

    def _resync_piece(self, piece: list[int]) -> pb.ResyncReply:
        """One Resync call absorbing `piece` (the server's last token first); on a lost session it is sent again
        with the whole verified history. Commits the reply's delta."""
        cfg, link, stats = self.cfg, self.link, self.output.stats
        V = self.text.verified
        rewind = cfg.policy == "rewind" and not self._absorbing()
        req = pb.ResyncRequest(
            session_id=link.session_id,
            resume_token=link.resume_token,
            verified_length=V,
            offline_tokens=piece,
            sampling=sampling_params(cfg, link.info, self.output.logprobs),
            **codec_fields(cfg.codec),
            model_fingerprint=link.info.model_fingerprint,
            rewind=rewind,
        )
        try:
            reply = link.stub.Resync(req, metadata=link.metadata, timeout=cfg.connect_timeout_s)
        except grpc.RpcError as e:
            reason = Refusal.of_rpc_error(e).reason
            if reason == pb.REASON_SESSION_FULL:
                link.close_session()  # no room left in it: a new session over the history takes the piece
                req.session_id = req.resume_token = ""
            elif reason != pb.REASON_HISTORY_REQUIRED:
                raise rpc_error(e) from None
            req.history.extend(self.text.sequence[:V])  # the server lost the session: it rebuilds from the history
            if link.info.sampling_controls:  # the penalties count the generated tokens of the history only
                req.prompt_length = min(len(self.text.prompt), V)
            stats.bytes_up += 4 * V
            try:
                reply = link.stub.Resync(req, metadata=link.metadata, timeout=cfg.connect_timeout_s)
            except grpc.RpcError as e2:
                raise rpc_error(e2) from None
        stats.bytes_up += 4 * len(piece)
        stats.resync_bytes.append((4 * len(piece) + (4 * V if len(req.history) else 0), len(reply.delta.payload)))
        stats.bytes_down += len(reply.delta.payload)
        self._check_reply(reply, V, piece, rewind)
        link.hold(reply.session_id, reply.resume_token)  # a rebuilt session has a new id
        self.drafter.commit(wire_delta(reply.delta))
        # The offline tokens it kept are verified now: tagged so, and told.
        for start, count in self.text.verify(reply.verified_length):
            self.output.tell(Event("verify", start=start, count=count))
        self.output.save()
        self._feed_from = self.text.verified  # the drafter holds exactly the verified positions: offline, it reads on
        return reply

    def _check_reply(self, reply: pb.ResyncReply, V: int, piece: list[int], rewind: bool) -> None:
        """A reply this resync can take, else a lost call (BadMessage): it absorbs a prefix of the piece, all of it
        unless asked to rewind (keep never retracts), from the client's verified length, and names a next token in
        the vocabulary and ids of the server's shape. The delta itself is the drafter's gate's to check."""
        kept = list(reply.delta.tokens)
        if not 1 <= len(kept) <= len(piece) or kept != piece[: len(kept)]:
            raise self.check.refused(Problem.DELTA, "a resync reply absorbed tokens that were not the piece sent")
        if not rewind and len(kept) != len(piece):
            raise self.check.refused(Problem.DELTA, "a resync under keep dropped offline tokens")
        if reply.delta.start != V or reply.verified_length != V + len(kept):
            raise self.check.refused(Problem.DELTA, f"a resync reply from {V} claims {reply.verified_length} positions")
        self.check.ids(reply.session_id, reply.resume_token)
        self.check.token(reply.target_token, "next token")
        self.check.logprobs(_target_logprob(reply), [reply.target_token])  # checked before the reply is taken

    def attach(self) -> None:
        stream = self.link.new_stream()
        att = pb.AttachSession(session_id=self.link.session_id, resume_token=self.link.resume_token)
        reply = stream.request(pb.ClientMessage(attach=att), self.cfg.connect_timeout_s)
        if reply.attached.verified_length != self.text.verified:
            raise ServerError(grpc.StatusCode.INTERNAL, "the server's verified length differs after resync")


def _target_logprob(reply: pb.ResyncReply) -> list[pb.TokenLogprob]:
    """The reply's logprob entry of its next token, as a list (none from a server not asked, or older)."""
    return [reply.target_logprob] if reply.HasField("target_logprob") else []
