"""The chat's parts without a server: the conversation rendered with the model's chat template (what a turn sends,
which copy of a reply it keeps, the tokens a template hides), Ctrl-C turned into a stop and then an interrupt, the
line reader (a pipe; readline's history file, bounded and owner-only), and the prompt loop's exit statuses.
The chat against real servers: tests/e2e/test_chat_e2e.py."""

import io
import json
import signal
import stat
import types

import pytest
from toy_models import toy_model_dir

from tether.client.chat import (
    HISTORY_LENGTH,
    Chat,
    Conversation,
    LineReader,
    default_history_file,
    interruptible,
    repl,
)
from tether.shared.chat_template import ChatFormat
from tether.shared.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


SPACED = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(toy_model_dir())


def test_a_turn_renders_the_whole_conversation_with_the_generation_prompt(tok):
    fmt = ChatFormat.builtin_for(tok)
    chat = Conversation(fmt, system="be brief")
    ids = chat.ask("hello", held=[])
    assert tok.decode(ids) == "<|endoftext|>system: be brief\nuser: hello\nassistant:"
    reply = tok.encode(" hi there") + [tok.eos_id]  # the end of text ends the reply and is no part of it
    assert chat.answer(reply) == " hi there"
    ids = chat.ask("again", held=ids + reply)
    assert [m["content"] for m in chat.messages] == ["be brief", "hello", " hi there", "again"]
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert tok.decode(ids).endswith("assistant: hi there\nuser: again\nassistant:")


def test_the_reply_is_kept_as_shown_unless_another_copy_keeps_more_of_the_session(tok):
    """A template that writes "assistant: " + content: a reply the model began with a space is kept without it (so
    the rendering extends the session's tokens); one the model began otherwise stays as shown. The built-in
    template renders every reply as the model wrote it, so it keeps each as shown."""
    builtin = ChatFormat.builtin_for(tok)
    spaced = ChatFormat(SPACED, builtin.specials, tok)
    for fmt, shown, kept in ((spaced, " x = 1", "x = 1"), (spaced, "\n    return x", "\n    return x"),
                             (builtin, " x = 1", " x = 1"), (builtin, "\n    return x", "\n    return x")):  # fmt: skip
        chat = Conversation(fmt)
        prompt = chat.ask("def f(x):", held=[])
        reply = tok.encode(shown)
        chat.answer(reply)
        ids = chat.ask("more", held=prompt + reply)
        assert chat.messages[1]["content"] == kept
        if fmt is builtin:
            assert ids[: len(prompt + reply)] == prompt + reply  # the next turn extends what the session holds


def test_tokens_the_template_hides_are_no_part_of_the_reply(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok.to_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    fmt = ChatFormat.from_model_dir(tmp_path, tok)
    chat = Conversation(fmt)
    ids = chat.ask("hi", held=[])
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.answer(tok.encode("hello") + [tok.eos_id]) == "hello"


def test_every_id_the_engine_ends_at_ends_a_reply_and_is_no_part_of_it(tok):
    """A chat ends where its engine ends (every end-of-text id, the stop token ids) and at the template's end of
    turn; the reply's text leaves them all out."""
    fmt = ChatFormat.builtin_for(tok)
    engine = types.SimpleNamespace(stop_ids=frozenset({7}))  # e.g. a second end-of-text id, or --stop-token-ids 7
    chat = Chat(engine, fmt)
    assert engine.stop_ids == {7} | fmt.stop_ids
    chat.conversation.ask("hi", held=[])
    assert chat.conversation.answer(tok.encode("hello") + [7]) == "hello"


def test_a_failed_turn_takes_its_message_back(tok):
    chat = Conversation(ChatFormat.builtin_for(tok))
    chat.ask("hello", held=[])
    chat.withdraw()
    assert chat.messages == []


def test_ctrl_c_stops_first_and_interrupts_second():
    stops = []
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), interruptible(lambda: stops.append(True)):
        signal.raise_signal(signal.SIGINT)
        assert stops == [True]  # the first: the generation is asked to stop, nothing is interrupted
        signal.raise_signal(signal.SIGINT)  # the second: no waiting for the step in progress
    assert stops == [True] and signal.getsignal(signal.SIGINT) is before


def test_a_pipe_gives_one_message_a_line():
    reader = LineReader(None, interactive=False, stdin=io.StringIO("one\r\ntwo\n\nthree"))
    assert [reader("> ") for _ in range(4)] == ["one", "two", "", "three"]
    with pytest.raises(EOFError):
        reader("> ")


def test_the_history_file_is_read_kept_bounded_and_owner_only(tmp_path):
    path = tmp_path / "state" / "tether" / "chat_history"
    reader = LineReader(path, interactive=True)
    rl = reader.readline
    rl.clear_history()
    try:
        rl.add_history("first message")
        reader.close()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "first message" in path.read_text()
        rl.clear_history()
        LineReader(path, interactive=True)
        assert rl.get_current_history_length() == 1 and rl.get_history_item(1) == "first message"
        assert rl.get_history_length() == HISTORY_LENGTH
    finally:
        rl.clear_history()


def test_the_history_lives_in_the_xdg_state_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_history_file() == tmp_path / "tether" / "chat_history"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_history_file() == tmp_path / ".local" / "state" / "tether" / "chat_history"


def test_the_prompt_loop_ends_with_0_on_end_of_input_and_130_on_ctrl_c(tok):
    conversation = Conversation(ChatFormat.builtin_for(tok))
    chat = types.SimpleNamespace(conversation=conversation)  # the loop reads no more of it before a message

    def reader(exc):
        def read(prompt):
            raise exc

        return read

    err = io.StringIO()
    assert repl(chat, reader(EOFError), out=None, err=err) == 0
    assert repl(chat, reader(KeyboardInterrupt), out=None, err=err) == 130
