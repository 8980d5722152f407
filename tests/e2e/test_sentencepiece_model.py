"""SentencePiece-style models end to end through the edge: a Llama-2-layout model folder (Metaspace and byte-fallback
BPE) and a T5-style Unigram one (tests/tiny_models.write_sentencepiece_checkpoint: generation_config.json lists two
end-of-text ids, tokenizer_config.json has a chat template and asks for clean_up_tokenization_spaces), served on
127.0.0.1 with a tiny drafter, driven by the edge client.

The target is scripted (tiny_models.script_greedy): after the prompt, and after the chat template's generation
prompt, greedy decoding writes a fixed continuation and then the second end-of-text id (`<|im_end|>`). So every
path must write exactly those tokens, and the text shown must be the tokenizer's: Metaspace's "▁" as spaces, a
character spelled in byte-fallback tokens (`<0xF0><0x9F><0x98><0x80>`) as that one character, Unigram's clean-up of
spaces before punctuation, never a literal `▁` or `<0x..>`.

- generate (the session and PlainStream view `tether-client generate --plain` runs): the edge drafts, the server
  verifies; it stops at the second end-of-text id; what it prints is its result's text, the tokenizer's decode
  of the continuation after its prompt (Tokenizer.decode(ids, after=prompt)): its first space kept, the end of
  text left out; `tether-client generate --json` and `--plain` print that text.
- Offline: the link is cut after the first verified round (an event), the edge writes alone, and when it tries to
  resync the link comes back; what it showed is the decode of what it wrote.
- Chat (Chat and ChatStream, as `tether-client chat`): the template renders and encodes the same on the edge, on
  the server and in transformers (no "▁" prepended after `<s>`); the reply ends at the second end-of-text id and
  reads as the tokenizer decodes it, without the end of turn.
- An edge decodes with the clean-up its server's model folder asks for (Unigram: " ?" reads "?").
- The server's OpenAI-compatible API on the same model: completions (streamed or not) and chat completions end at
  the second end-of-text id and read as decoded, a completion keeping its first space after the prompt.
- The edge's OpenAI-compatible API (`tether-client serve`) on the same model: a completion and a chat completion end
  at the second end-of-text id too, with the text the server's API answers.

Faults strike on events, never on the clock. A few seconds per family on 2 cores.
"""

import dataclasses
import io
import json
from pathlib import Path

import pytest
from edge_text import continuation, run_text
from rich.console import Console
from test_edge_api_e2e import Endpoint
from tiny_models import END_OF_TURN, script_greedy, tiny_moa_drafter, write_sentencepiece_checkpoint

from tether.client.chat import Chat
from tether.client.cli import main as cli_main
from tether.client.live_view import ChatStream, PlainStream
from tether.client.session import ClientConfig, EdgeSession, Event, State
from tether.client.session_types import Result
from tether.netsim.proxy import NetSimThread
from tether.server.engine_core import Engine
from tether.server.http_api import start_http
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.chat_template import ChatFormat
from tether.shared.checkpoint import fingerprint
from tether.shared.openai_app import HttpConfig
from tether.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

PROMPT = "The quick"
USER = "Hi"
# Continuations whose tokens are all different (the script maps a token to the next), in each family's vocabulary.
CONTINUATION = {
    "byte_fallback": " there, café😀!",  # "é" and "😀" are byte-fallback tokens, 2 and 4 of them
    "unigram": " dog ? Isn't it.",  # " ?" is cleaned up to "?" (clean_up_tokenization_spaces)
}
BOUND_S = 120  # a safety net for waits that end on events, never a timing assumption


class Model:
    """The scripted model folder of one family, served with a tiny drafter on 127.0.0.1."""

    def __init__(self, family: str, root: Path) -> None:
        self.family, self.folder = family, write_sentencepiece_checkpoint(root / family, family)
        tok = Tokenizer.from_pretrained(self.folder)
        self.chat = ChatFormat.from_model_dir(self.folder, tok)
        self.prompt_ids = tok.encode(PROMPT)
        self.chat_ids = self.chat.encode(self.chat.render([{"role": "user", "content": USER}]))
        self.continuation = tok.encode(CONTINUATION[family])
        self.end_of_turn = tok.eos_ids[1]
        assert tok.decode([self.end_of_turn]) == END_OF_TURN and self.end_of_turn != tok.eos_id
        starts = {self.prompt_ids[-1], self.chat_ids[-1]}
        assert len(set(self.continuation)) == len(self.continuation) and not starts & set(self.continuation)
        chain = [*self.continuation, self.end_of_turn]
        script_greedy(self.folder, {**dict.fromkeys(starts, chain[0]), **dict(zip(chain[:-1], chain[1:], strict=True))})
        target, self.tok = load(self.folder, "cpu")
        self.service = TetherService(Engine(target, tiny_moa_drafter(target), self.tok, ServiceConfig(),
                                     model_fingerprint=fingerprint(self.folder), chat_format=self.chat))  # fmt: skip
        self.server, port = make_server(self.service, "127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.http, http_port = start_http(self.service.engine, family, HttpConfig(port=0))
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                                 timeout=BOUND_S)  # fmt: skip

    @property
    def expected(self) -> list[int]:
        """What greedy decoding writes after the prompt or the generation prompt: the continuation, then the end
        of turn (the second end-of-text id), where it stops."""
        return [*self.continuation, self.end_of_turn]

    def close(self) -> None:
        self.http.stop()
        self.server.stop(None)
        self.service.engine.close()


@pytest.fixture(scope="module", params=sorted(CONTINUATION))
def model(request, tmp_path_factory):
    served = Model(request.param, tmp_path_factory.mktemp("sentencepiece"))
    yield served
    served.close()


def assert_reads_as_text(text: str) -> None:
    """No token spelling leaks into what the user reads: Metaspace's "▁", byte-fallback's "<0x..>", a split
    character's U+FFFD, the end of turn."""
    for leak in ("▁", "<0x", "\ufffd", END_OF_TURN):
        assert leak not in text, (leak, text)


def edge_config(model: Model, tmp_path, **overrides) -> ClientConfig:
    """The edge's settings for these tests: rounds sent ahead of their verdicts as by default."""
    return ClientConfig(
        server=model.address, max_new_tokens=24, cache_dir=str(tmp_path / "cache"), mode="hybrid", **overrides
    )


def plain_stream(session: EdgeSession, out: io.StringIO) -> PlainStream:
    """What `tether-client generate --plain` streams: the continuation after the prompt, without its stop ids."""
    tok = session.models.tokenizer
    return PlainStream(tok, out=out, err=io.StringIO(), context=tok.encode(PROMPT), hidden=session.stop_ids)


def generate(model: Model, tmp_path, **overrides) -> tuple[Result, str, str, Tokenizer]:
    """`tether-client generate --plain`'s session and view: the result, its text (the continuation decoded, as the
    command decodes it), what it printed after the prompt, and the edge's tokenizer (the server's tokenizer.json
    with the end-of-text ids and clean-up the server names)."""
    shown = io.StringIO()
    session = EdgeSession(edge_config(model, tmp_path, **overrides))
    try:
        session.pair()
        session.on_event = plain_stream(session, shown).on_event
        result = run_text(session, PROMPT)
    finally:
        session.close()
    return result, continuation(session, result), shown.getvalue(), session.models.tokenizer


# ---- generate --------------------------------------------------------------------------------------------------


def test_generate_through_the_edge_writes_the_script_and_shows_the_tokenizers_text(model, tmp_path):
    result, text, shown, edge_tok = generate(model, tmp_path)
    assert result.token_ids == model.expected  # stopped at the second end-of-text id
    assert set(result.tags) == {"verified"} and result.stats.drafted > 0
    assert edge_tok.eos_ids == model.tok.eos_ids and edge_tok.clean_up_spaces == model.tok.clean_up_spaces
    assert shown == text  # streamed as the result's text says
    assert END_OF_TURN not in shown and text.strip() == model.tok.decode(model.continuation).strip()
    if model.family == "byte_fallback":
        assert "café😀" in shown and model.tok.encode("😀")[-4:] == [3 + b for b in "😀".encode()]  # <0x..> is 3 + b
    else:
        assert "dog? Isn't it." in shown  # " ?" cleaned up as transformers decodes this model
    assert_reads_as_text(shown)


def test_what_the_user_reads_is_the_continuation_after_its_prompt(model, tmp_path):
    want = model.tok.decode(model.continuation, after=model.prompt_ids)
    assert want.startswith(" ") and want.strip() == model.tok.decode(model.continuation)  # the space the prompt gives
    _, text, shown, _ = generate(model, tmp_path)
    assert text == want and shown == want


def test_generate_commands_text_is_the_continuation_after_its_prompt(model, tmp_path, capsys):
    """`tether-client generate --json` and `--plain` print the same text as the session's result."""
    want = model.tok.decode(model.continuation, after=model.prompt_ids)
    flags = ["generate", "--server", model.address, "--prompt", PROMPT, "--max-new-tokens", "24"]
    assert cli_main([*flags, "--json", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == want
    assert cli_main([*flags, "--plain", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out == PROMPT + want + "\n"


def test_the_servers_http_api_answers_with_the_tokenizers_text(model):
    """The server's OpenAI-compatible API on the same model: completions, streamed or not, and a chat completion
    end at the second end-of-text id ("stop") and read as the tokenizer decodes, the end of text left out."""
    reply = model.tok.decode(model.continuation)
    done = model.api.completions.create(model=model.family, prompt=PROMPT, max_tokens=24, temperature=0)
    (choice,) = done.choices
    assert choice.finish_reason == "stop" and done.usage.completion_tokens == len(model.expected)
    assert choice.text.strip() == reply.strip()
    stream = model.api.completions.create(model=model.family, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == choice.text
    chat = model.api.chat.completions.create(model=model.family, messages=[{"role": "user", "content": USER}],
                                             max_tokens=24, temperature=0)  # fmt: skip
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content.strip() == reply.strip()
    assert chat.usage.prompt_tokens == len(model.chat_ids)  # the template encoded as transformers encodes it
    for text in (choice.text, chat.choices[0].message.content):
        assert_reads_as_text(text)


def test_the_edges_http_api_ends_at_the_second_end_of_text_as_the_servers(model, tmp_path):
    """`tether-client serve`'s API in front of the same server: the edge drafts, the server verifies, and a
    completion and a chat completion stop at the second end-of-text id with the server's API's text."""
    edge = Endpoint(model.address, str(tmp_path / "cache"), "keep", max_new_tokens=24)
    chat = [{"role": "user", "content": USER}]
    answers = []
    try:
        for ask, name in ((model.api, model.family), (edge.client, edge.backend.model_id)):
            done = ask.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0)
            reply = ask.chat.completions.create(model=name, messages=chat, max_tokens=24, temperature=0)
            answers.append([(r.usage.completion_tokens, c.finish_reason) for r, c in
                            ((done, done.choices[0]), (reply, reply.choices[0]))])  # fmt: skip
            answers[-1].append((done.choices[0].text, reply.choices[0].message.content))
    finally:
        edge.close()
    served, on_edge = answers
    assert on_edge == served and on_edge[:2] == [(len(model.expected), "stop")] * 2
    for text in on_edge[2]:
        assert_reads_as_text(text)


def test_a_completion_keeps_its_first_space_after_the_prompt(model):
    want = model.tok.decode(model.continuation, after=model.prompt_ids)
    done = model.api.completions.create(model=model.family, prompt=PROMPT, max_tokens=24, temperature=0)
    assert done.choices[0].text == want


# ---- offline --------------------------------------------------------------------------------------------------


class CutAfterFirstRound:
    """Cuts the link once a round is verified; restores it when the session tries to resync having written
    alone. Streams what the user reads (PlainStream) into `shown`."""

    def __init__(self, sim: NetSimThread, session: EdgeSession) -> None:
        self.sim, self.session = sim, session
        self.shown = io.StringIO()
        self.stream = plain_stream(session, self.shown)
        self.cut = self.restored = False
        self.offline = 0

    def __call__(self, e: Event) -> None:
        self.stream.on_event(e)
        if e.kind == "tokens" and e.tag == "offline":
            self.offline += len(e.tokens)
        if not self.cut and e.kind == "tokens" and e.tag == "verified":
            self.cut = True
            self.sim.cut()
        elif self.cut and not self.restored and e.kind == "state" and e.state == State.RESYNCING:
            if self.offline or self.session.done:
                self.restored = True
                self.sim.restore()


def test_offline_drafting_shows_the_decode_of_what_it_wrote(model, tmp_path):
    sim = NetSimThread(("127.0.0.1", 0), model.address)
    sim.start()
    cfg = edge_config(model, tmp_path, policy="keep", k=2, round_timeout_s=30.0, connect_timeout_s=30.0,
                      backoff_initial_s=0.02, backoff_max_s=0.1, pace_tokens_per_s=200,
                      final_resync_s=BOUND_S)  # fmt: skip
    session = EdgeSession(dataclasses.replace(cfg, server=sim.address))
    try:
        session.pair()
        session.on_event = faults = CutAfterFirstRound(sim, session)
        result = run_text(session, PROMPT)
    finally:
        sim.stop()
        session.close()
    assert faults.cut and faults.restored and result.stats.offline_tokens >= 1
    text = continuation(session, result)
    assert faults.shown.getvalue() == text
    tok = session.models.tokenizer
    written = tok.decode([t for t in result.token_ids if t not in session.stop_ids], after=tok.encode(PROMPT))
    assert text == written
    assert "▁" not in text and "<0x" not in text  # whatever the drafter wrote alone


# ---- chat -----------------------------------------------------------------------------------------------------


def test_the_chat_template_renders_the_same_on_the_edge_the_server_and_in_transformers(model, tmp_path):
    session = EdgeSession(ClientConfig(mode="hybrid", server=model.address, cache_dir=str(tmp_path)))
    try:
        session.pair()
        on_edge = ChatFormat.from_json(session.info.chat_format_json, session.models.tokenizer)
    finally:
        session.close()
    messages = [{"role": "user", "content": USER}, {"role": "assistant", "content": "café 😀 ok"},
                {"role": "user", "content": "And you?"}]  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(str(model.folder))
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    assert on_edge.render(messages) == model.chat.render(messages) == want
    assert on_edge.encode(want) == model.chat.encode(want) == want_ids
    assert on_edge.stop_ids == model.chat.stop_ids == set(model.tok.eos_ids)


def test_a_chat_reply_ends_at_the_second_end_of_text_and_reads_as_decoded(model, tmp_path):
    """A turn as `tether-client chat` takes it: the edge renders the server's template, the reply streams through
    ChatStream (the end of turn and special tokens hidden) and ends at the second end-of-text id."""
    out = io.StringIO()
    session = EdgeSession(edge_config(model, tmp_path))
    session.pair()
    chat = Chat(session, ChatFormat.from_json(session.info.chat_format_json, session.models.tokenizer))
    view = ChatStream(session.models.tokenizer, chat.conversation.hidden, console=Console(file=out), err=io.StringIO())
    try:
        result = chat.reply(USER, view.on_event)
    finally:
        chat.close()
    assert result.prompt_ids == model.chat_ids and result.token_ids == model.expected
    reply = model.tok.decode(model.continuation)  # the template writes its own space before a reply
    assert out.getvalue().strip() == reply.strip() == chat.conversation.messages[-1]["content"].strip()
    assert_reads_as_text(reply)


def test_an_edge_cleans_up_spaces_as_the_servers_model_folder_asks(model, tmp_path):
    """transformers cleans up spaces before punctuation for a Unigram model whose folder asks, never for BPE; the
    edge's tokenizer, built from tokenizer.json alone, does what the server says (ModelInfo)."""
    session = EdgeSession(edge_config(model, tmp_path))
    try:
        session.pair()
        edge_tok = session.models.tokenizer
    finally:
        session.close()
    assert edge_tok.clean_up_spaces == model.tok.clean_up_spaces == (model.family == "unigram")
    assert edge_tok.decode(model.continuation) == model.tok.decode(model.continuation)
