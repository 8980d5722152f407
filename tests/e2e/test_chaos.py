"""Server, netsim and client together on loopback, the link cut and stalled while the client generates.

- rewind: the final text equals plain greedy decoding of the target, token for token;
- keep: no token lost or duplicated (every token emitted verified is the target's greedy choice after the
  tokens before it, so a lost or doubled token would show), and after every resync the client's TLI K/V equal
  the server's, bit for bit (lossless codec: the server's bf16 wire values);
- the server killed and restarted mid-generation (it forgets every session): the client rebuilds its session
  from the full history and rewind still reproduces plain decoding.

Every fault is struck on an event, never on the clock: after the client's Nth verified round, or inside the
server's Nth Resync call, and the link comes back when the client, having written M tokens alone, tries to resync.
The client stops drafting alone after MAX_OFFLINE tokens and waits for the link, and no outage starts without room
for that many, so every outage ends in a resync mid-generation however fast or slow the machine is. Timeouts only
decide how soon the client notices a stall; no assertion depends on how long anything takes.
"""

import dataclasses
import random
import threading

import pytest
import torch
from edge_text import run_text
from toy_models import toy_model_dir

from tether.client.resync import Resync
from tether.client.session import ClientConfig, EdgeSession, Event, LinkDown, SessionLost, State
from tether.client.transport import SessionStream
from tether.netsim.proxy import NetSimThread
from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

PROMPT = "def read_config(path):\n    with open(path"
N_NEW = 120
K = 5  # draft tokens per round
MAX_OFFLINE = 16  # tokens the client writes alone in one outage before it waits for the link
ROOM = K + 1 + MAX_OFFLINE  # an outage starts only with this many tokens still to write: it ends mid-generation


@pytest.fixture(scope="module")
def models():
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    plain = list(target.generate(torch.tensor([tok.encode(PROMPT)]), N_NEW))
    return target, drafter, tok, plain


# ---- the server, and the only places these tests touch its internals ---------------------------------------------


def make_service(models) -> TetherService:
    target, drafter, tok, _ = models
    return TetherService(Engine(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(toy_model_dir())))


def serve(service: TetherService, port: int = 0):
    server, port = make_server(service, f"127.0.0.1:{port}")
    server.start()
    return server, port


def stop(server) -> None:
    """Stop at once and wait until the server has (a restart reuses its port)."""
    server.stop(None).wait(30)


def server_verifier(service: TetherService, session_id: str):
    return service.engine.sessions[session_id].verifier


def after_each_resync_call(service: TetherService, hook) -> None:
    """hook() runs inside every Resync call the server answers, after it has absorbed the piece and before the reply
    leaves. Install before make_server, which takes the bound method."""
    real = service.Resync

    async def resync(request, context):
        reply = await real(request, context)
        hook()
        return reply

    service.Resync = resync


def refused(service: TetherService, code: str) -> float:
    return service.engine.metrics.registry.get_sample_value("tether_errors_total", {"code": code}) or 0.0


# ---- faults struck on events ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outage:
    """One outage. It strikes once the client has verified `rounds` rounds since the link last came back or, with
    `call` set, inside the server's `call`-th Resync call from then on, after the server has absorbed the piece (a
    cut loses the reply; a stall holds it past the client's deadline). A cut lasts until the client tries to resync
    having written `offline` tokens alone (or unable to write more: its limit, or the end of the text); a stall
    until the client tries to resync at all, which it does only once its round or call has timed out."""

    kind: str  # "cut" or "stall"
    rounds: int = 1
    call: int = 0
    offline: int = 1


def random_outages(seed: int, n: int = 5) -> list[Outage]:
    """n outages whose kinds and event counts (never times) come from `seed`. After the first, one in three strikes
    inside the first Resync call once the link is back (rewind's resync may need no second call)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.choice(["cut", "stall"])
        call = int(i > 0 and rng.random() < 1 / 3)
        out.append(Outage(kind, rounds=rng.randint(1, 6), call=call, offline=rng.randint(1, MAX_OFFLINE)))
    return out


class Faults:
    """Plays outages one after another on the client's events (on_event) and the server's Resync calls
    (on_resync_call); `struck` lists the kinds that happened. Either may run on its own thread: a lock orders them."""

    def __init__(self, sim: NetSimThread, session: EdgeSession, outages: list[Outage]):
        self.sim, self.session, self.pending = sim, session, list(outages)
        self.struck: list[str] = []
        self.current: Outage | None = None
        self.lock = threading.Lock()
        self.rounds_back = 0  # the client's verified rounds when the link last came back
        self.calls = 0  # Resync calls the server answered since then
        self.written = 0  # tokens the client wrote alone in this outage
        self.run = 0  # tokens it wrote alone since its last verified one (what max_offline_tokens counts)

    def _room(self) -> bool:
        return len(self.session.tokens) + ROOM < self.session.cfg.max_new_tokens

    def _strike(self) -> None:
        self.current = self.pending.pop(0)
        self.written = 0
        self.sim.cut() if self.current.kind == "cut" else self.sim.stall()
        self.struck.append(self.current.kind)

    def on_event(self, e: Event) -> None:
        s = self.session
        with self.lock:
            if e.kind == "tokens":
                if e.tag == "offline":
                    self.written += len(e.tokens)
                    self.run += len(e.tokens)
                else:
                    self.run = 0
            if self.current is None:
                nxt = self.pending[0] if self.pending else None
                between_rounds = e.kind == "tokens" and e.tag == "verified" and s.state == State.ONLINE
                if nxt and not nxt.call and between_rounds and s.stats.rounds - self.rounds_back >= nxt.rounds:
                    if self._room():
                        self._strike()
                    else:
                        self.pending.clear()
            elif e.kind == "state" and e.state == State.RESYNCING:
                o = self.current
                if o.kind == "stall" or self.written >= o.offline or self.run >= s.cfg.max_offline_tokens or s.done:
                    self.sim.restore()
                    self.current = None
                    self.rounds_back, self.calls = s.stats.rounds, 0

    def on_resync_call(self) -> None:
        with self.lock:
            if self.current is None and self.pending and self.pending[0].call:
                self.calls += 1
                if self.calls >= self.pending[0].call and self._room():
                    self._strike()


def resyncs_owed(struck: list[Outage]) -> int:
    """Each outage struck between rounds ends in a resync of its own (one struck inside a resync only delays that)."""
    return sum(1 for o in struck if not o.call)


def client_config(address: str, tmp_path, policy: str, piece: int = 1024) -> ClientConfig:
    """piece: offline tokens per Resync call; a small one makes every resync take several calls."""
    return ClientConfig(server=address, max_new_tokens=N_NEW, policy=policy, k=K, cache_dir=str(tmp_path / "cache"),
                        round_timeout_s=1.0, connect_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.4,
                        mode="hybrid", pace_tokens_per_s=120, max_offline_tokens=MAX_OFFLINE, final_resync_s=60,
                        resync_piece_tokens=piece)  # fmt: skip


def run_with_faults(models, tmp_path, policy: str, outages: list[Outage], on_event=None, piece: int = 1024,
                    limit: int = 0):  # fmt: skip
    """limit: the message size the server's resync replies must fit (0: its default, 4 MiB). on_event(session,
    service, event) sees every client event before the faults do. Returns the result, the kinds struck and the
    service."""
    service = make_service(models)
    holder: list[Faults] = []
    after_each_resync_call(service, lambda: holder[0].on_resync_call())
    server, port = serve(service)
    if limit:  # the service's own check only: gRPC's limit stays, so the weights still come in big chunks
        service.engine.config = dataclasses.replace(service.engine.config, max_message_bytes=limit)
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
    sim.start()
    session = EdgeSession(client_config(sim.address, tmp_path, policy, piece))
    faults = Faults(sim, session, outages)
    holder.append(faults)

    def events(e: Event) -> None:
        if on_event:
            on_event(session, service, e)
        faults.on_event(e)

    try:
        session.pair()  # the weights come over a clean link; the faults start with generation
        session.on_event = events
        result = run_text(session, PROMPT)
    finally:
        session.close()
        sim.stop()
        stop(server)
    return result, faults.struck, service


@pytest.mark.parametrize(("seed", "piece"), [(1, 1024), (2, 1)], ids=["one_call", "pieces_of_1"])
def test_rewind_under_random_cuts_and_stalls_equals_plain_greedy(models, tmp_path, seed, piece):
    # Pieces of one token: every piece keeps its root, so whether the next call happens is decided by the
    # piece-boundary check alone (the next offline token against the target's token after the piece).
    outages = random_outages(seed)
    result, struck, _ = run_with_faults(models, tmp_path, "rewind", outages, piece=piece)
    assert len(struck) >= 2, struck
    assert result.stats.resyncs >= resyncs_owed(outages[: len(struck)])
    assert result.token_ids == models[3]


def test_rewind_survives_the_link_dropping_between_resync_and_attach(models, tmp_path, monkeypatch):
    """The Resync succeeds but the stream after it cannot be attached (every other time): the target's token from
    the resync must already be the client's, or it drafts on from a token the target never chose and the next
    resync hands that to the server as its root."""
    real, dropped, beyond = Resync.attach, [], []

    def attach_once_in_two(self: Resync):
        resyncing, text = self.output.state == State.RESYNCING, self.text
        if resyncing and len(text.tokens) < self.cfg.max_new_tokens:
            beyond.append(len(text.sequence) - text.verified)  # the decided token is in the text: exactly 1
        if resyncing and len(dropped) % 2 == 0:
            dropped.append(1)
            raise LinkDown("the link dropped right after the resync (test)")
        dropped.append(0)
        return real(self)

    monkeypatch.setattr(Resync, "attach", attach_once_in_two)
    result, struck, _ = run_with_faults(models, tmp_path, "rewind", random_outages(2))
    assert struck and sum(dropped) >= 1, "no attach was dropped"
    assert beyond and set(beyond) == {1}
    assert result.token_ids == models[3]


# Pieces of 2 make every resync several calls, so faults can strike inside one (after the server has absorbed the
# piece): cut at its 2nd call, stalled at the 1st of the retry, then, after another outage, stalled at the 3rd.
IN_RESYNC = [Outage("cut", rounds=2, offline=8), Outage("cut", call=2, offline=3), Outage("stall", call=1),
             Outage("cut", rounds=3, offline=MAX_OFFLINE), Outage("stall", call=3)]  # fmt: skip


@pytest.mark.parametrize(("outages", "piece"), [(random_outages(3), 1024), (IN_RESYNC, 2)],
                         ids=["random_one_call", "inside_resync_calls"])  # fmt: skip
def test_keep_loses_and_doubles_nothing_and_kv_matches_the_server_bit_for_bit(models, tmp_path, outages, piece):
    checked, trail = [], []  # trail: every state change, said when an assertion fails (which resync went missing)
    chosen = []  # the indices of the tokens the target chose (emitted verified; those a resync kept are tagged later)

    def after_resync(session, service, e):
        if e.kind == "tokens" and e.tag == "verified":
            chosen.extend(range(len(session.tokens) - len(e.tokens), len(session.tokens)))
        if e.kind == "state":
            trail.append((e.state.name, e.detail[:60], session.stats.resyncs, len(session.tokens)))
        # Right after a resync the server holds exactly what the client verified: compare the TLI K/V. The first
        # state change after it is ONLINE, or OFFLINE when the stream after it could not be attached (a loaded
        # machine: the attach's deadline passed); nothing is verified in between either way. Checking at ONLINE only
        # missed such a resync whenever the text then ended offline, where keep stops without another resync.
        if e.kind == "state" and session.stats.resyncs > len(checked):
            ver = server_verifier(service, session.link.session_id)
            caches = session.drafter.backend  # the onnxruntime drafter's, its TLI caches numpy [N, capacity, Hkv, D]
            n = caches.tli
            L = session.verified
            assert ver.length == L
            client_k = torch.from_numpy(caches.tli_k[:, :L])
            client_v = torch.from_numpy(caches.tli_v[:, :L])
            for i in range(n):
                server_k, server_v = ver.cache.rows(ver.target.cfg.n_layers - n + i)
                assert torch.equal(client_k[i], server_k.to(torch.bfloat16).float())
                assert torch.equal(client_v[i], server_v.to(torch.bfloat16).float())
            checked.append(L)

    result, struck, _ = run_with_faults(models, tmp_path, "keep", outages, after_resync, piece=piece)
    assert len(struck) >= 2 and len(checked) >= resyncs_owed(outages[: len(struck)]), (struck, checked, trail)
    if piece == 2:
        assert struck == [o.kind for o in IN_RESYNC]
    assert len(result.token_ids) == N_NEW and result.stats.retracted == 0
    target, _, tok, _ = models
    seq = tok.encode(PROMPT) + result.token_ids
    with torch.inference_mode():
        greedy = target(torch.tensor([seq])).argmax(-1)[0].tolist()
    P = len(tok.encode(PROMPT))
    for i in chosen:
        assert seq[P + i] == greedy[P + i - 1], f"token {i} emitted verified is not the target's choice"
    assert result.stats.offline_tokens >= outages[0].offline


def test_keep_halves_its_resync_pieces_when_a_reply_would_pass_the_message_limit(models, tmp_path):
    """A server whose replies must fit ~4 tokens' delta: the client's first pieces are refused (RESOURCE_EXHAUSTED,
    "smaller pieces"), it halves them until they fit, and nothing is lost or doubled."""
    # One cut, the link back only once the client holds MAX_OFFLINE tokens: one resync of 1 + MAX_OFFLINE tokens.
    outages = [Outage("cut", rounds=3, offline=MAX_OFFLINE)]
    result, struck, service = run_with_faults(models, tmp_path, "keep", outages, limit=1024 + 4 * 1300)
    assert struck == ["cut"] and result.stats.resyncs >= 1
    assert refused(service, "RESOURCE_EXHAUSTED") >= 2  # 17 tokens, then 8, before pieces of 4 fit
    assert len(result.stats.resync_bytes) > result.stats.resyncs
    assert max(down for _, down in result.stats.resync_bytes) <= 4 * 1300
    assert len(result.token_ids) == N_NEW and result.stats.retracted == 0


def test_server_restart_mid_generation_is_recovered_by_a_full_history_resync(models, tmp_path):
    service = make_service(models)
    server, port = serve(service)
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
    sim.start()
    session = EdgeSession(client_config(sim.address, tmp_path, "rewind", piece=5))  # the rebuild, then pieces
    servers = [server]
    offline = []

    def kill_then_restart(e: Event) -> None:
        if e.kind == "tokens" and e.tag == "offline":
            offline.extend(e.tokens)
        if len(servers) == 1 and e.kind == "tokens" and len(session.tokens) >= 30:
            stop(servers[0])  # every session is gone with it
            servers.append(None)
        elif servers[-1] is None and e.kind == "state" and e.state == State.RESYNCING and len(offline) >= 8:
            servers[-1] = serve(make_service(models), port)[0]  # a new process on the same port: nothing held

    try:
        session.pair()
        session.on_event = kill_then_restart
        result = run_text(session, PROMPT)
    finally:
        session.close()
        sim.stop()
        for s in servers:
            if s is not None:
                stop(s)
    assert len(servers) == 2 and servers[1] is not None
    assert result.stats.rebuilt >= 1
    assert result.token_ids == models[3]


def test_rewind_that_ends_offline_with_every_token_absorbed_has_nothing_left_to_resync(models, tmp_path, monkeypatch):
    """The link is cut after the first round and the client writes the rest alone (here the target's own tokens, so
    rewind's resync absorbs the whole tail); the stream after that resync cannot attach (the session was evicted
    meanwhile). Every token is verified, so the client finishes: it once sent a Resync of nothing and died on
    INVALID_ARGUMENT (sixteen clients on a full server hit it)."""
    plain = models[3]

    def oracle_step(self: Resync):
        self.offline_run += 1
        self.output.stats.offline_tokens += 1
        self.output.emit([plain[len(self.text.tokens)]], "offline")

    real_attach = Resync.attach

    def attach(self: Resync):
        if session.done:
            raise SessionLost("evicted right after the resync (test)")
        return real_attach(self)

    monkeypatch.setattr(Resync, "offline_step", oracle_step)
    monkeypatch.setattr(Resync, "attach", attach)
    service = make_service(models)
    server, port = serve(service)
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
    sim.start()
    cfg = dataclasses.replace(client_config(sim.address, tmp_path, "rewind"), max_offline_tokens=0)
    session = EdgeSession(cfg)

    def on_event(e: Event) -> None:
        if e.kind == "tokens" and e.tag == "verified" and session.stats.rounds == 1 and session.stats.outages == 0:
            sim.cut()
        elif e.kind == "state" and e.state == State.RESYNCING and session.done:
            sim.restore()

    try:
        session.pair()
        session.on_event = on_event
        result = run_text(session, PROMPT)
    finally:
        session.close()
        sim.stop()
        stop(server)
    assert result.stats.offline_tokens > 0 and result.stats.resyncs == 1 and result.stats.retracted == 0
    assert result.token_ids == plain


def test_opens_that_fail_leave_no_stream_behind(models, tmp_path, monkeypatch):
    """Each failed open (the link stalled: no answer within connect_timeout_s) is tried again on a new stream; the
    one before is closed, so no gRPC thread is left waiting on it for good."""
    made, closed = [], set()
    real_init, real_close = SessionStream.__init__, SessionStream.close

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def close(self):
        closed.add(id(self))
        real_close(self)

    monkeypatch.setattr(SessionStream, "__init__", init)
    monkeypatch.setattr(SessionStream, "close", close)
    service = make_service(models)
    server, port = serve(service)
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
    sim.start()
    cfg = ClientConfig(server=sim.address, cache_dir=str(tmp_path), max_new_tokens=8, connect_timeout_s=0.5,
                       mode="hybrid", backoff_initial_s=0.01, backoff_max_s=0.02)  # fmt: skip
    session = EdgeSession(cfg, connect_attempts=3)
    try:
        session.pair()  # the weights over a clean link; then every open meets a stalled one
        sim.stall()
        with pytest.raises(LinkDown):
            run_text(session, PROMPT)
    finally:
        session.close()
        sim.stop()
        stop(server)
        service.engine.close()
    assert len(made) == 3 and all(id(s) in closed for s in made)
