"""`tether-client chat` and `generate` against real servers on 127.0.0.1 (the toy models on the CPU).

- A chat keeps one server session across turns and sends only each turn's new tokens (Resync absorbs them), and
  each greedy reply equals what a fresh session over the whole rendered conversation gives; a reply ends at the
  template's end of turn. With the built-in template of the toy models too: `tether-client chat` opens one
  server session for a whole conversation, never reopening it.
- The server unreachable between turns: the reply is drafted alone, then the next turn resyncs into the same
  server session and is verified again.
- Ctrl-C (a real SIGINT, sent on an event) stops a reply, which stays in the conversation, and the chat goes on;
  `generate` ends with status 130; the server session is closed either way.
- A server without a drafter: generate and chat stream from Generate with the tokenizer it sends (or --tokenizer),
  and say server-only; a tampered tokenizer is refused in one line.
- The command line: the prompt from stdin or a file, time to first token and tokens/s in --json, the download's
  progress bar only when the client part is not cached; a message the chat template refuses is answered with one
  line and the chat goes on.

Faults strike on events (a token count, a turn's end), never on the clock; waits are bounded only as a safety net.
"""

import io
import json
import signal

import grpc
import pytest
import torch
from toy_models import toy_model_dir

from tether.client import live_view
from tether.client.chat import Chat
from tether.client.cli import main
from tether.client.server_only import ServerOnlySession, load_tokenizer
from tether.client.session import ClientConfig, EdgeSession
from tether.netsim.proxy import NetSimThread
from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.chat_template import ChatFormat
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.weights import TOKENIZER_TENSOR

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

NEW = 24  # tokens a reply may have
BOUND_S = 60  # a safety net for waits that end on events
PROMPT = "def read_config(path):\n    with open(path"
# A template that writes each message as the model would continue it ("assistant:" then the reply as written), so
# every turn's rendering extends the last: the chat can always keep its server session.
VERBATIM = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
TURNS = ["def fib(n):", "now in one line", "and a test for it"]


@pytest.fixture(scope="module")
def models():
    target, tok = load(toy_model_dir(), "cpu")
    return target, load_drafter(toy_model_dir("drafter"), target), tok


@pytest.fixture
def servers(models):
    """Started on demand: servers(drafter=True, template=None) -> (address, service); stopped after the test (each
    holds a KV pool of its own: a module's worth at once would be gigabytes)."""
    started = []

    def start(drafter: bool = True, template: str | None = None):
        target, draft, tok = models
        chat = ChatFormat(template, {}, tok) if template else None
        service = TetherService(Engine(target, draft if drafter else None, tok, ServiceConfig(),
                                model_fingerprint=fingerprint(toy_model_dir()), chat_format=chat))  # fmt: skip
        server, port = make_server(service, "127.0.0.1:0")
        server.start()
        started.append((server, service))
        return f"127.0.0.1:{port}", service

    yield start
    for server, service in started:
        server.stop(None)
        service.engine.close()  # its batcher and executor threads would keep it, its KV pool among it, to the end


def config(address: str, tmp_path, **kw) -> ClientConfig:
    return ClientConfig(mode="hybrid", server=address, max_new_tokens=NEW, cache_dir=str(tmp_path / "cache"), **kw)


def paired_chat(address: str, tmp_path, **kw) -> tuple[Chat, EdgeSession]:
    session = EdgeSession(config(address, tmp_path, **kw))
    session.pair()
    fmt = ChatFormat.from_json(session.info.chat_format_json, session.models.tokenizer)
    return Chat(session, fmt), session


def fresh_reply(address: str, tmp_path, prompt_ids: list[int], stop_ids) -> list[int]:
    """What a new session over the whole rendered conversation answers."""
    session = EdgeSession(config(address, tmp_path))
    try:
        session.pair()
        session.stop_ids = stop_ids
        return session.run(list(prompt_ids)).token_ids
    finally:
        session.close()


# ---- turns -------------------------------------------------------------------------------------------------------


def test_a_chat_keeps_one_server_session_and_its_replies_are_a_fresh_sessions(servers, tmp_path):
    address, service = servers(template=VERBATIM)
    chat, session = paired_chat(address, tmp_path)
    opened = service.engine.metrics.registry.get_sample_value("tether_sessions_opened_total") or 0
    ids, results = [], []
    try:
        for text in TURNS:
            results.append(chat.reply(text))
            ids.append(session.link.session_id)
        assert service.engine.sessions.keys() == {ids[0]}  # one session, still held between turns
    finally:
        chat.close()
    assert not service.engine.sessions  # closed at the end
    assert len(set(ids)) == 1 and [r.stats.reopened for r in results] == [0, 0, 0]
    assert (service.engine.metrics.registry.get_sample_value("tether_sessions_opened_total") or 0) == opened + 1
    for prev, r in zip(results, results[1:], strict=False):  # the turn's Resync: only what the session lacked
        held = len(prev.prompt_ids) + len(prev.token_ids) - 1  # all but the last token (the root) was verified
        assert r.stats.resync_bytes == [(4 * (len(r.prompt_ids) - held), r.stats.resync_bytes[0][1])]
        assert r.tags == ["verified"] * len(r.token_ids)
    for r in results:
        assert r.token_ids == fresh_reply(address, tmp_path, r.prompt_ids, chat.conversation.format.stop_ids)
    rendered = chat.conversation.ids(chat.conversation.messages[:-1])
    assert rendered[: len(results[-1].prompt_ids)] == results[-1].prompt_ids


def test_a_reply_ends_at_the_templates_end_of_turn(servers, tmp_path):
    address, _ = servers(template=VERBATIM)
    chat, _ = paired_chat(address, tmp_path)
    try:
        free = chat.reply(TURNS[0]).token_ids
    finally:
        chat.close()
    end = free[3]  # a token the model writes as its fourth: made the end of turn, the reply stops at it
    session = EdgeSession(config(address, tmp_path))
    session.pair()
    fmt = ChatFormat(VERBATIM, {}, session.models.tokenizer, extra_stop_ids=(end,))
    chat = Chat(session, fmt)
    try:
        reply = chat.reply(TURNS[0]).token_ids
    finally:
        chat.close()
    assert reply == free[: free.index(end) + 1]
    assert chat.conversation.messages[-1]["content"] == session.models.tokenizer.decode(reply[:-1])


def test_the_server_unreachable_between_turns_drafts_alone_then_resyncs_into_the_same_session(servers, tmp_path):
    address, service = servers(template=VERBATIM)
    port = int(address.rsplit(":", 1)[1])
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
    sim.start()
    chat, session = paired_chat(sim.address, tmp_path, round_timeout_s=2.0, connect_timeout_s=5.0)
    try:
        first = chat.reply(TURNS[0])
        held = session.link.session_id
        sim.cut()
        alone = chat.reply(TURNS[1])
        sim.restore()
        grpc.channel_ready_future(session.link.replicas.channel).result(timeout=BOUND_S)
        back = chat.reply(TURNS[2])
        after = session.link.session_id
    finally:
        chat.close()
        sim.stop()
    assert first.tags == ["verified"] * NEW
    assert len(alone.token_ids) == NEW and alone.tags == ["offline"] * NEW and alone.stats.reopened == 0
    assert back.tags == ["verified"] * len(back.token_ids) and back.stats.reopened == back.stats.rebuilt == 0
    assert after == held
    assert back.token_ids == fresh_reply(address, tmp_path, back.prompt_ids, chat.conversation.format.stop_ids)
    assert not service.engine.sessions


def test_ctrl_c_stops_a_reply_which_stays_in_the_conversation(servers, tmp_path):
    address, service = servers(template=VERBATIM)
    chat, session = paired_chat(address, tmp_path)
    shown: list[int] = []
    sent = []

    def interrupt_after_three(e) -> None:
        if e.kind == "tokens":
            shown.extend(e.tokens)
            if len(shown) >= 3 and not sent:
                sent.append(True)
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, once: a second one would end the chat

    try:
        cut = chat.reply(TURNS[0], interrupt_after_three)
        whole = chat.reply(TURNS[1])
    finally:
        chat.close()
    assert cut.stats.stopped and 3 <= len(cut.token_ids) < NEW and cut.token_ids == shown
    assert chat.conversation.messages[1] == {"role": "assistant",
                                             "content": session.models.tokenizer.decode(cut.token_ids)}  # fmt: skip
    assert not whole.stats.stopped and whole.stats.reopened == 0
    assert not service.engine.sessions


# ---- the command line ----------------------------------------------------------------------------------------


def test_chat_from_a_pipe_answers_each_line_and_closes_its_session(servers, tmp_path, monkeypatch, capsys):
    address, service = servers(template=VERBATIM)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TURNS) + "\n"))
    args = ["chat", "--server", address, "--max-new-tokens", str(NEW), "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"connecting to {address}\n")
    assert err.count("tokens/s") == len(TURNS) and "first token" in err
    assert out.count("\n") >= len(TURNS) and not service.engine.sessions


def test_a_chat_in_the_builtin_template_keeps_one_server_session(servers, tmp_path, monkeypatch, capsys):
    """The toy models' replies start with a newline or a space after "assistant:"; the built-in template renders
    them back exactly, so every turn extends the server session (a Resync) and none reopens it."""
    address, service = servers()
    assert json.loads(service.engine.model_info.chat_format_json)["builtin"]
    metric = service.engine.metrics.registry.get_sample_value
    opened = metric("tether_sessions_opened_total") or 0
    extended = metric("tether_resyncs_total", {"outcome": "extended"}) or 0
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TURNS) + "\n"))
    # Resyncs are counted exactly: a round slower than the default 5 s timeout on a starved machine would be an
    # outage, and its resync one more extension than the turns make.
    args = [
        "chat",
        "--server",
        address,
        "--max-new-tokens",
        str(NEW),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--round-timeout-s",
        "120",
    ]
    assert main(args) == 0
    assert capsys.readouterr().err.count("tokens/s") == len(TURNS)
    assert (metric("tether_sessions_opened_total") or 0) == opened + 1
    assert (metric("tether_resyncs_total", {"outcome": "extended"}) or 0) == extended + len(TURNS) - 1
    assert not service.engine.sessions


def test_a_message_the_template_refuses_is_answered_in_one_line_and_the_chat_goes_on(servers, tmp_path, monkeypatch,
                                                                                     capsys):  # fmt: skip
    picky = ("{% for m in messages %}{% if m['content'] == 'forbidden' %}{{ raise_exception('no such\nmessage') }}"
             "{% endif %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
    address, service = servers(template=picky)
    monkeypatch.setattr("sys.stdin", io.StringIO("forbidden\n" + TURNS[0] + "\n"))
    args = ["chat", "--server", address, "--max-new-tokens", str(NEW), "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    err = capsys.readouterr().err
    refusals = [line for line in err.splitlines() if line.startswith("[tether: not sent:")]
    assert refusals == ["[tether: not sent: the chat template refused the conversation: no such message]"]
    assert err.count("tokens/s") == 1 and "Traceback" not in err and not service.engine.sessions


def test_ctrl_c_in_generate_ends_it_with_130_and_closes_the_session(servers, tmp_path, monkeypatch, capsys):
    address, service = servers()
    real = live_view.PlainStream.on_event
    sent = []

    def interrupting(self, e) -> None:
        real(self, e)
        if e.kind == "tokens" and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(live_view.PlainStream, "on_event", interrupting)
    args = ["generate", "--server", address, "--prompt", PROMPT, "--cache-dir", str(tmp_path / "cache"), "--plain"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "stopped" in err and "Traceback" not in err and not service.engine.sessions


def test_generate_reads_the_prompt_from_stdin_or_a_file_and_reports_ttft_and_rate(servers, tmp_path, monkeypatch,
                                                                                   capsys):  # fmt: skip
    address, _ = servers()
    common = ["--server", address, "--max-new-tokens", str(NEW), "--cache-dir", str(tmp_path / "cache"), "--json"]
    assert main(["generate", "--prompt", PROMPT, *common]) == 0
    given = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    assert main(["generate", "--prompt", "-", *common]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == given["token_ids"]
    (tmp_path / "prompt.txt").write_text(PROMPT, encoding="utf-8")
    assert main(["generate", "--prompt-file", str(tmp_path / "prompt.txt"), *common]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["token_ids"] == given["token_ids"] and err == ""  # --json: nothing on stderr
    stats = given["stats"]
    assert stats["ttft_s"] > 0 and stats["tokens_per_s"] > 0 and stats["server_only"] is False


def test_the_progress_bar_shows_for_a_download_and_not_for_a_cached_part(servers, tmp_path, capsys):
    address, _ = servers()
    args = ["generate", "--server", address, "--prompt", PROMPT, "--max-new-tokens", "4", "--progress", "--plain",
            "--cache-dir", str(tmp_path / "fresh")]  # fmt: skip
    assert main(args) == 0
    assert "client part" in capsys.readouterr().err
    assert main(args) == 0
    assert "client part" not in capsys.readouterr().err


# ---- a server without a drafter ------------------------------------------------------------------------------


def test_generate_and_chat_stream_from_a_server_without_a_drafter(servers, models, tmp_path, monkeypatch, capsys):
    address, service = servers(drafter=False)
    target, _, tok = models
    plain = [int(t) for t in target.generate(torch.tensor([tok.encode(PROMPT)]), NEW)]
    plain = plain[: plain.index(tok.eos_id) + 1] if tok.eos_id in plain else plain
    common = ["--server", address, "--max-new-tokens", str(NEW), "--cache-dir", str(tmp_path / "cache")]
    assert main(["generate", "--prompt", PROMPT, "--json", *common]) == 0  # its tokenizer fetched from the server
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == plain and result["stats"]["server_only"] is True
    model = str(toy_model_dir())
    assert main(["generate", "--prompt", PROMPT, "--json", "--tokenizer", model, *common]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain
    assert main(["generate", "--prompt", PROMPT, "--plain", "--tokenizer", model, *common]) == 0
    assert "server-only" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TURNS[:2]) + "\n"))
    assert main(["chat", *common]) == 0
    assert capsys.readouterr().err.count("server-only") == 2 and not service.engine.sessions


def test_a_tampered_tokenizer_from_a_server_without_a_drafter_is_refused_in_one_line(servers, tmp_path, capsys):
    address, service = servers(drafter=False)
    data = service.engine.tokenizer_files[TOKENIZER_TENSOR]
    service.engine.tokenizer_files = {TOKENIZER_TENSOR: data[:-2] + b" }"}  # the manifest's sha256 no longer holds
    try:
        args = ["generate", "--prompt", PROMPT, "--server", address, "--cache-dir", str(tmp_path / "cache")]
        assert main(args) == 2
    finally:
        service.engine.tokenizer_files = {TOKENIZER_TENSOR: data}
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.startswith(f"connecting to {address}\n")
    assert "invalid weight checksum" in err and "Traceback" not in err


def test_a_server_only_chat_renders_the_whole_conversation_each_turn(servers, models, tmp_path):
    address, _ = servers(drafter=False, template=VERBATIM)
    session = EdgeSession(config(address, tmp_path))
    try:
        info = session.model_info()
        tok = load_tokenizer(toy_model_dir(), info)
        fmt = ChatFormat.from_json(info.chat_format_json, tok)
        chat = Chat(ServerOnlySession(session.link.stub, session.link.metadata, session.cfg, info, tok), fmt)
        first = chat.reply(TURNS[0])
        second = chat.reply(TURNS[1])
    finally:
        session.close()
    assert second.prompt_ids == fmt.encode(fmt.render(chat.conversation.messages[:-1]))
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert first.stats.server_only and second.stats.bytes_up == 4 * len(second.prompt_ids)
