"""The edge client's text surfaces with a SentencePiece-style tokenizer (Llama-2 layout: Metaspace, byte fallback):
the plain stream, a chat's stream and the live view's per-token text show exactly the tokenizer's decode, the
leading space dropped as transformers drops it, a character spelled in byte tokens whole, and nothing held back
once the generation is done (State.DONE releases the last character). `tether-client generate`'s plain stream and
live view, given the prompt's ids and the ids the generation ends at, show the continuation after the prompt (its
first space kept) without those ids. A tokenizer built in-process, no model.
Run: `python -m pytest tests/client/test_live_view_text.py -q`."""

import io

import pytest
import tokenizers
from rich.console import Console
from tokenizers import decoders, models, pre_tokenizers

from tether.client.live_view import ChatStream, LiveView, PlainStream, token_texts
from tether.client.session_types import Event, State
from tether.client.split_view import SplitView
from tether.shared.tokenizer import Tokenizer

TEXT = "hi 中 ih"  # "中" has no token of its own: three byte tokens (at the end of "hi 中")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        **{f"<0x{b:02X}>": 3 + b for b in range(256)},
        "▁": 259,
        "h": 260,
        "i": 261,
    }
    backend = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer.from_tokenizers(backend, eos_id=2)


@pytest.mark.parametrize("text", [TEXT, "hi 中"])
def test_plain_and_chat_streams_show_the_decode_and_release_the_end(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text and 3 + 0xE4 in ids  # byte fallback, and the leading "▁" dropped
    out, err = io.StringIO(), io.StringIO()
    plain = PlainStream(tok, out=out, err=err)
    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    chat = ChatStream(tok, hidden={tok.eos_id}, console=console, err=err)
    for sink in (plain, chat):
        for i in [*ids, tok.eos_id]:
            sink.on_event(Event("tokens", tokens=[i], tag="verified"))
        sink.on_event(Event("state", state=State.DONE))
    assert out.getvalue() == text + "</s>"  # the plain stream shows every id, end of text included
    assert console.file.getvalue() == text
    assert err.getvalue() == ""


def test_token_texts_join_to_the_decode(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    pieces = token_texts(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == TEXT
    assert "\ufffd" not in "".join(pieces)


def test_generates_views_show_the_continuation_after_its_prompt_without_the_ids_it_ends_at(tok: Tokenizer) -> None:
    """The plain stream and the live view, given the prompt's ids and the ids that end the generation (every
    end-of-text id, the stop token ids): the text a continuation adds to its prompt, its first space kept, and no
    stop id's text, a retracted one included."""
    prompt, ids = tok.encode("ih"), tok.encode(TEXT)
    want = tok.decode(ids, after=prompt)
    assert want == " " + TEXT  # the space the prompt gives the continuation's leading "▁"
    out = io.StringIO()
    plain = PlainStream(tok, out=out, err=io.StringIO(), context=prompt, hidden={tok.eos_id})
    view = LiveView(tok, "ih", console=Console(file=io.StringIO(), width=100), context=prompt, hidden={tok.eos_id})
    for sink in (plain, view):
        for i in [*ids, tok.eos_id]:
            sink.on_event(Event("tokens", tokens=[i], tag="verified"))
    view.on_event(Event("retract", count=1))
    view.on_event(Event("tokens", tokens=[tok.eos_id], tag="offline"))
    plain.on_event(Event("state", state=State.DONE))
    assert out.getvalue() == want
    assert view._render().renderable.renderables[0].plain == "ih" + want


def test_the_demos_panes_show_the_continuation_after_its_prompt_without_end_of_text(tok: Tokenizer) -> None:
    """The demo's split view reads as generate shows: after the prompt (a first space kept), no end-of-text text, in
    its whole and in a tail that starts after the first tokens."""
    ids = tok.encode(TEXT)
    view = SplitView(tok, "ih", console=Console(file=io.StringIO(), width=80, height=24))
    for i in [*ids, tok.eos_id]:
        view.hybrid.on_event(Event("tokens", tokens=[i], tag="verified"))
    assert view.hybrid.text(100).plain == "ih " + TEXT
    tail = tok.decode(ids[2:], after=[*tok.encode("ih"), *ids[:2]])
    assert view.hybrid.text(len(ids) - 1).plain == tail and tail.endswith("中 ih")  # its last len(ids) - 1 tokens
