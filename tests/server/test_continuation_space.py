"""A SentencePiece-style continuation reads as it does after its prompt on the server: `tether-server generate` and
/v1/completions keep its first space ("The quick" + "▁there" reads "The quick there", where decoding "▁there"
alone drops the space), as transformers' text-generation pipeline and vLLM return it; a chat's reply is a new turn
and is decoded alone.

The model is tests/tiny_models' scripted Llama-2-layout folder (Metaspace and byte-fallback BPE): after the prompt
greedy decoding writes a fixed continuation and then the second end-of-text id. No drafter: only the decode is
under test. A few seconds on 2 cores.
"""

import httpx
import pytest
from sse import sse_events
from tiny_models import script_greedy, write_sentencepiece_checkpoint

from tether.server.engine_core import Engine
from tether.server.generate import GenerateConfig, generate_text
from tether.server.http_api import start_http
from tether.server.model_loading import load
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.chat_template import ChatFormat
from tether.shared.checkpoint import fingerprint
from tether.shared.openai_app import HttpConfig
from tether.shared.text_stream import TextStream
from tether.shared.tokenizer import Tokenizer

PROMPT = "The quick"
CONTINUATION = " there, café"  # "é" is two byte-fallback tokens
BOUND_S = 60  # a safety net, never a timing assumption


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = write_sentencepiece_checkpoint(tmp_path_factory.mktemp("sp") / "model", "byte_fallback")
    tok = Tokenizer.from_pretrained(folder)
    prompt, continuation = tok.encode(PROMPT), tok.encode(CONTINUATION)
    chain = [*continuation, tok.eos_ids[1]]
    assert len(set(chain)) == len(chain) and prompt[-1] not in chain
    script_greedy(folder, {prompt[-1]: chain[0], **dict(zip(chain[:-1], chain[1:], strict=True))})
    return folder


def test_text_stream_reads_a_continuation_after_its_context(folder):
    tok = Tokenizer.from_pretrained(folder)
    prompt, continuation = tok.encode(PROMPT), tok.encode(CONTINUATION)
    want = tok.decode(continuation, after=prompt)
    assert want.startswith(" there") and not tok.decode(continuation).startswith(" ")  # the case under test
    stream = TextStream(tok, stop_ids=frozenset(tok.eos_ids), context=prompt)
    pieces = [stream.push(t) for t in [*continuation, tok.eos_ids[1]]]
    assert "".join(pieces) == want and stream.finish_reason == "stop"


def test_generate_keeps_the_first_space(folder):
    tok = Tokenizer.from_pretrained(folder)
    out = generate_text(GenerateConfig(model=str(folder), prompt=PROMPT, drafter="none", max_new_tokens=16,
                                       device="cpu"))  # fmt: skip
    assert out["token_ids"] == [*tok.encode(CONTINUATION), tok.eos_ids[1]]
    assert out["text"] == tok.decode(tok.encode(CONTINUATION), after=tok.encode(PROMPT)) == CONTINUATION


def test_completions_keep_the_first_space_and_a_chat_reply_is_its_own(folder):
    target, tok = load(folder, "cpu")
    chat = ChatFormat.from_model_dir(folder, tok)
    service = TetherService(Engine(target, None, tok, ServiceConfig(), model_fingerprint=fingerprint(folder),
                            chat_format=chat))  # fmt: skip
    http, port = start_http(service.engine, "sp", HttpConfig(port=0))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        body = {"model": "sp", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        done = httpx.post(url + "/completions", json=body, timeout=BOUND_S).json()["choices"][0]
        assert (done["text"], done["finish_reason"]) == (CONTINUATION, "stop")
        events = sse_events(url + "/completions", body | {"stream": True}, BOUND_S)
        pieces = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
        assert "".join(pieces) == CONTINUATION and pieces[0].startswith(" ")  # the space comes with the first word
        # A chat's reply starts a turn of its own: the generation prompt's last token is not read before it.
        messages = [{"role": "user", "content": "Hi"}]
        ids = chat.encode(chat.render(messages))
        reply = httpx.post(url + "/chat/completions", json={"model": "sp", "messages": messages, "max_tokens": 4,
                                                            "temperature": 0}, timeout=BOUND_S).json()  # fmt: skip
        content = reply["choices"][0]["message"]["content"]
        assert reply["usage"]["prompt_tokens"] == len(ids) and "▁" not in content
    finally:
        http.stop()
        service.engine.close()
