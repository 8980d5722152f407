"""The session table: which sessions the server holds, who owns them, and the KV memory each one holds.

Contract:
- It alone creates and retires sessions, so it alone takes KV memory for them and gives it back
  (`create` makes the session's paged cache; `retire` releases it; `lend` / `give_back` a cache for a Generate
  stream's lifetime). Blocks in use in the pool always equal `blocks_held()`, and are zero once every
  session is gone: a property test drives random calls and checks it.
- Room is checked before anything is allocated (`create`): a key over its session quota is refused
  (REASON_KEY_QUOTA, retry when its oldest idle session's lease ends); at `max_sessions` the least recently used
  idle session is evicted, and when every session is busy the caller is refused (REASON_CAPACITY, retryable).
- Leases: a session idle for `lease_s` expires (`expire`, run periodically and before every `create`): its
  quota and KV go back, its next round answers REASON_SESSION_EVICTED and its client rebuilds it by a resync.
  A session whose opening call ended before its answer was sent is retired at once (`abandon`), and so is a fresh
  one whose opening or rebuilding call was cancelled (its claim is released as soon as no thread uses it).
- Claims: handlers use a session through `claim` (an async context manager), which serialises them per
  session and marks the session busy, so eviction (which the KV pool triggers from worker threads when it runs
  short, `reclaim`) never takes the KV of a session whose round or resync is running. A claim whose work was
  handed to a thread (a batch, a prefill) is released only when that work ends (`Claim.hand_over`), even if the
  caller's call was cancelled meanwhile.
- Session ids and resume tokens are chosen here: 128 random bits, 32 lowercase hex digits.

Threads: everything but `reclaim` runs on the server's event loop; the table's lock guards the dict and each
session's `busy` and `evicted` flags, which `reclaim` reads on a worker thread.

    table = SessionTable(pool, make_verifier, TableLimits(max_sessions=256, lease_s=300))
    session, claim = await table.create(owner, sampling, codec, capacity)
    async with table.claim(session):
        ...
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tether.server.errors import Reason, RequestError
from tether.server.frontend_wire import VerdictFrame
from tether.server.kv_pool import KVPool, PagedCache
from tether.server.round_ticket import RoundTicket
from tether.server.session_lock import SessionLock
from tether.server.verifier import SequenceVerifier
from tether.shared.codecs import Codec
from tether.shared.ids import new_session_id
from tether.v1 import tether_pb2 as pb

log = logging.getLogger("tether.server")

BUSY_RETRY_S = 0.25  # retry advice when every session is busy (a round takes milliseconds)


@dataclass(frozen=True)
class TableLimits:
    max_sessions: int = 256  # sessions held at once; past it the least recently used idle one is evicted
    max_sessions_per_key: int = 64  # sessions one API key may hold at once (with authentication)
    lease_s: float = 300.0  # a session idle this long expires: its quota and KV go back
    engine: int | None = None  # this engine's index in its session ids (serve --engines); None: one engine


@dataclass(eq=False)
class Session:
    id: str
    owner: str  # hash of the API key that opened it ("" without authentication)
    verifier: SequenceVerifier
    sampling: pb.SamplingParams
    codec: Codec
    resume_token: str = field(default_factory=new_session_id)
    root: int = 0  # the last decided token, which the next round must start from
    last_round: int = 0
    last_reply: pb.ServerMessage | VerdictFrame | None = None  # sent again for a repeated round
    resyncs: int = 0  # resyncs answered; a stream attached before the latest one may send no more rounds
    last_used: float = 0.0  # the table's clock; for leases and least-recently-used eviction
    busy: int = 0  # claims in progress (guarded by the table's lock)
    evicted: bool = False  # its KV was given back (guarded by the table's lock)
    lock: SessionLock = field(default_factory=SessionLock)  # serialises this session's handlers


class Claim:
    """One handler's hold on a session: released once, by the handler or by the work it handed to a thread.
    The claim on a session just created is `fresh`: unless the handler calls `keep()` (its client has been told
    the id), releasing it retires the session, so a failed or cancelled open or rebuild leaves nothing behind."""

    def __init__(self, table: SessionTable, session: Session, *, fresh: bool = False):
        self.table, self.session, self.fresh = table, session, fresh
        self._loop = asyncio.get_running_loop()
        self._handed = False
        self._done = False

    def keep(self) -> None:
        self.fresh = False

    def hand_over(self, work: concurrent.futures.Future | RoundTicket) -> None:
        """The session stays busy until `work` ends (a thread is using its verifier), not until the caller ends."""
        self._handed = True
        work.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._release))

    def release(self) -> None:
        if not self._handed:
            self._release()

    def _release(self) -> None:
        if self._done:
            return
        self._done = True
        if self.fresh:
            self.table.retire(self.session, "failed")
        with self.table._lock:
            self.session.busy -= 1
            self.session.last_used = self.table.clock()
        self.session.lock.release()

    async def __aenter__(self) -> Session:
        return self.session

    async def __aexit__(self, *exc) -> None:
        self.release()


class SessionTable:
    def __init__(
        self,
        pool: KVPool,
        make_verifier: Callable[[pb.SamplingParams, int], SequenceVerifier],
        limits: TableLimits,
        *,
        metrics=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool, self.make_verifier, self.limits = pool, make_verifier, limits
        self.metrics, self.clock = metrics, clock
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._transient: set[PagedCache] = set()
        pool.reclaim = self._reclaim

    # ---- reading ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def snapshot(self) -> dict[str, Session]:
        with self._lock:
            return dict(self._sessions)

    def lookup(self, session_id: str, owner: str) -> Session | None:
        """The session, if it exists and `owner` owns it: to any other key it does not exist."""
        with self._lock:
            s = self._sessions.get(session_id)
        return s if s is not None and secrets.compare_digest(s.owner.encode(), owner.encode()) else None

    def blocks_held(self) -> int:
        """KV blocks held by live sessions and Generate streams: all the pool should have in use."""
        with self._lock:
            caches = [s.verifier.cache for s in self._sessions.values()] + list(self._transient)
        return sum(len(c.blocks) for c in caches if isinstance(c, PagedCache))

    # ---- claims -----------------------------------------------------------------------------------------

    async def claim(self, session: Session) -> Claim:
        """Wait for the session's other handlers, then hold it. REASON_SESSION_EVICTED if its KV was given back."""
        await session.lock.acquire()
        return self._held(session)

    def try_claim(self, session: Session) -> Claim | None:
        """`claim` without waiting, for a caller that is no coroutine (a round taken from its frame): None when
        another handler holds the session or waits for it. REASON_SESSION_EVICTED as `claim`."""
        return self._held(session) if session.lock.try_acquire() else None

    def _held(self, session: Session) -> Claim:
        with self._lock:
            if session.evicted:
                session.lock.release()
                raise RequestError(Reason.REASON_SESSION_EVICTED, "session evicted: resync with the full history")
            session.busy += 1
            session.last_used = self.clock()
        return Claim(self, session)

    # ---- creating and retiring --------------------------------------------------------------------------

    async def create(
        self, owner: str, sampling: pb.SamplingParams, codec: Codec, capacity: int
    ) -> tuple[Session, Claim]:
        """A new session with a fresh id and resume token, claimed by the caller. Raises REASON_KEY_QUOTA or
        REASON_CAPACITY (with retry advice) before anything is allocated. Its KV blocks are taken as the caller
        prefills it; if that fails the caller retires it."""
        self._make_room(owner)
        session = Session(
            new_session_id(self.limits.engine), owner, self.make_verifier(sampling, capacity), sampling, codec
        )
        await session.lock.acquire()  # a fresh lock: never waits
        with self._lock:
            session.busy, session.last_used = 1, self.clock()
            self._sessions[session.id] = session
            self._count()
        return session, Claim(self, session, fresh=True)

    def retire(self, session: Session, reason: str) -> None:
        """Drop the session and give its KV back. The caller holds its claim, so nothing else is using it."""
        with self._lock:
            dropped = self._drop(session)
        if dropped:
            self._release(session, reason)

    def abandon(self, session: Session) -> None:
        """Retire a session whose opening call ended before its answer went out, unless a claim holds it (its id
        reached someone after all). Its client can only rebuild it by a resync, as after an eviction."""
        if not session.lock.locked():
            self.retire(session, "abandoned")

    def expire(self) -> int:
        """Retire every idle session whose lease has ended; returns how many."""
        now = self.clock()
        with self._lock:
            gone = [s for s in self._sessions.values() if not s.busy and now - s.last_used >= self.limits.lease_s]
            gone = [s for s in gone if self._drop(s)]
        for s in gone:
            self._release(s, "lease")
        return len(gone)

    def lend(self, capacity: int) -> PagedCache:
        """A cache for a stream that is not a session (Generate); the stream gives it back however it ends."""
        cache = self.pool.sequence(capacity)
        with self._lock:
            self._transient.add(cache)
        return cache

    def give_back(self, cache: PagedCache) -> None:
        with self._lock:
            self._transient.discard(cache)
        cache.release()

    def close_all(self) -> None:
        """Give back every session's KV (server shutdown)."""
        with self._lock:
            gone = [s for s in self._sessions.values() if not s.busy]
            gone = [s for s in gone if self._drop(s)]
        for s in gone:
            self._release(s, "shutdown")

    # ---- internals --------------------------------------------------------------------------------------

    def _make_room(self, owner: str) -> None:
        lim = self.limits
        self.expire()
        with self._lock:
            mine = [s for s in self._sessions.values() if s.owner == owner]
            if owner and len(mine) >= lim.max_sessions_per_key:
                idle = [s.last_used for s in mine if not s.busy]
                wait = max(0.1, min(idle) + lim.lease_s - self.clock()) if idle else BUSY_RETRY_S
                raise RequestError(
                    Reason.REASON_KEY_QUOTA,
                    f"this key holds {len(mine)} sessions, the limit is {lim.max_sessions_per_key}",
                    retry_after_s=wait,
                )
        while True:
            with self._lock:
                if len(self._sessions) < lim.max_sessions:
                    return
            if not self._evict_lru("sessions"):
                raise RequestError(
                    Reason.REASON_CAPACITY, f"all {lim.max_sessions} sessions are busy", retry_after_s=BUSY_RETRY_S
                )

    def _evict_lru(self, reason: str) -> bool:
        """Evict the least recently used idle session; False when every session is busy."""
        with self._lock:
            idle = [s for s in self._sessions.values() if not s.busy]
            if not idle:
                return False
            victim = min(idle, key=lambda s: s.last_used)
            self._drop(victim)
        self._release(victim, reason)
        return True

    def _reclaim(self, missing: int) -> bool:
        """The pool's callback (on whichever thread is allocating) when `missing` more blocks are needed."""
        goal = self.pool.free_blocks + missing
        freed = False
        while self.pool.free_blocks < goal and self._evict_lru("memory"):
            freed = True
        return freed

    def _drop(self, session: Session) -> bool:
        """Remove from the dict and mark evicted (the caller holds the lock); False if that happened before."""
        if session.evicted:
            return False
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
        session.evicted = True
        self._count()
        return True

    def _release(self, session: Session, reason: str) -> None:
        length = session.verifier.length
        session.verifier.release()
        if self.metrics is not None and reason != "closed":
            self.metrics.evictions.labels(reason=reason).inc()
        event = "close" if reason == "closed" else "evict"
        log.info(
            f"session {'closed' if reason == 'closed' else 'evicted'}",
            extra={"event": event, "session": session.id, "reason": reason, "length": length},
        )

    def _count(self) -> None:
        if self.metrics is not None:
            self.metrics.sessions.set(len(self._sessions))
