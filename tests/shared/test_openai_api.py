"""The OpenAI API's protocol without a server: requests parsed into frozen values with every malformed or
unsupported field refused by name, the error body and Retry-After (tether.shared.openai_api), and TextStream
(tether.shared.text_stream): stop strings matched on the decoded text across token boundaries (held back only while
they may still match), characters split across tokens, end-of-text and hidden special tokens, and a tokenizer that
is not byte-level."""

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tether.shared.logits_processing import SamplingControls
from tether.shared.openai_api import (
    ApiError,
    ErrorKind,
    Sampling,
    parse_chat,
    parse_completion,
)
from tether.shared.text_stream import TextStream
from tether.shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(texts=["The quick brown fox jumps over the lazy dog. END here é.\n"] * 20, vocab_size=300)


def test_completion_request_defaults_and_values():
    req = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                            "top_k": -1, "seed": -1, "stop": "x", "stream": True,
                            "stream_options": {"include_usage": True}, "n": 1, "user": "u"})  # fmt: skip
    assert (req.chat, req.model, req.prompt, req.max_tokens, req.stop, req.stream, req.include_usage) == (
        False, "m", "hi", 5, ("x",), True, True)  # fmt: skip
    assert req.sampling == Sampling(temperature=0.0, top_p=0.5, top_k=0, seed=(1 << 64) - 1)
    plain = parse_completion({"prompt": [[1, 2, 3]]})
    assert plain.prompt == (1, 2, 3) and plain.sampling.temperature == 1.0 and plain.max_tokens is None
    assert 0 <= plain.sampling.seed < 1 << 63  # drawn for the request
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]},
                                    {"role": "assistant", "content": None}], "max_completion_tokens": 7})  # fmt: skip
    assert chat.messages == ({"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""})
    assert chat.max_tokens == 7


def test_sampling_controls_and_stop_token_ids():
    """vLLM's and OpenAI's names, OpenAI's string-keyed logit_bias; Sampling.controls is the rule they make."""
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "temperature": 0.5, "min_p": 0.1,
                      "presence_penalty": -0.5, "frequency_penalty": 2, "repetition_penalty": 1.2,
                      "logit_bias": {"7": -100, "3": 2.5}, "stop_token_ids": [4, 9, 4]})  # fmt: skip
    s = req.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, -0.5, 2.0, 1.2)
    assert s.logit_bias == ((3, 2.5), (7, -100.0)) and s.stop_token_ids == (4, 9)
    assert s.controls == SamplingControls(temperature=0.5, min_p=0.1, presence_penalty=-0.5, frequency_penalty=2,
                                          repetition_penalty=1.2, logit_bias={7: -100, 3: 2.5})  # fmt: skip
    neutral = parse_completion({"prompt": "x", "temperature": 0}).sampling
    assert not neutral.controls.processes_logits and neutral.stop_token_ids == ()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": "1"}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "seed": 1 << 64}, "seed"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1": True}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": 3}, "stop_token_ids"),
        ({"prompt": "x", "stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "x", "messages": []}, "messages"),
    ],
)
def test_completion_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.kind is ErrorKind.INVALID_REQUEST and e.value.param == param
    assert e.value.body()["error"]["param"] == param and e.value.kind.status == 400


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
         "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ],
)  # fmt: skip
def test_chat_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.param == param


def test_error_body_and_retry_after():
    e = ApiError(ErrorKind.OVERLOADED, "full", retry_after_s=0.25)
    assert e.body() == {"error": {"message": "full", "type": "server_error", "param": None, "code": "overloaded"}}
    assert e.headers() == {"Retry-After": "1"} and ErrorKind.RATE_LIMITED.status == 429
    assert ApiError(ErrorKind.INTERNAL, "x").headers() == {}


def run(stream: TextStream, ids: list[int]) -> tuple[str, int]:
    out = []
    for i in ids:
        out.append(stream.push(i))
        if stream.finish_reason:
            break
    else:
        out.append(stream.flush())
    return "".join(out), stream.tokens


def test_stop_strings_across_tokens_and_held_text(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    assert run(TextStream(tok), ids) == (text, len(ids))
    got, used = run(TextStream(tok, ["n fox j", "zzz"]), ids)
    assert got == "The quick brow" and used < len(ids)
    k = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("dog"))
    stream = TextStream(tok, ["dog!"])  # "dog" is held while it may become "dog!", and given out once it cannot
    pieces = [stream.push(i) for i in ids[:k]]
    assert "".join(pieces) == text[: text.index("dog")] and stream.finish_reason is None
    assert "".join(pieces) + stream.push(ids[k]) + "".join(stream.push(i) for i in ids[k + 1 :]) == text
    stopped = TextStream(tok, ["lazy"])
    run(stopped, ids)
    with pytest.raises(ValueError):
        stopped.push(ids[0])  # a finished stream takes no more tokens


def test_split_characters_eos_and_hidden_tokens(tok):
    data = "é".encode()
    one_byte = [tok.encode_bytes(data[:1])[0], tok.encode_bytes(data[1:])[0]]  # é as two byte tokens
    stream = TextStream(tok, stop_ids=frozenset({tok.eos_id}), hidden_ids=frozenset({tok.pad_id}))
    assert stream.push(one_byte[0]) == "" and stream.push(tok.pad_id) == "" and stream.push(one_byte[1]) == "é"
    assert stream.push(tok.eos_id) == "" and stream.finish_reason == "stop" and stream.tokens == 4
    cut = TextStream(tok)
    assert cut.push(one_byte[0]) == "" and cut.flush() == "\ufffd"  # an unfinished character at the length limit


def test_a_tokenizer_that_is_not_byte_level():
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer.from_tokenizers(backend)
    assert run(TextStream(tok), [1, 2, 3]) == ("hello world!", 3)
    assert run(TextStream(tok, ["d!"]), [1, 2, 3]) == ("hello worl", 3)
