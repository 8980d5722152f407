"""Chat templates (tether.shared.chat_template) against transformers' own apply_chat_template on the same model
directory: the rendered text and the token ids, for a ChatML template with special tokens, a Llama-3-style one
with bos_token, loop controls, tojson and {% generation %}, raise_exception as a typed refusal; the built-in
template of tether's models, which renders a reply sent back as it was generated exactly as the model saw it; the
ways a template is stored; the stop ids; the JSON form an edge client gets, and every malformed one refused as a
typed ChatTemplateError; and an import that leaves torch out."""

import json
import subprocess
import sys

import pytest
import tokenizers

from tether.shared.chat_template import BUILTIN_TEMPLATE, ChatFormat, ChatTemplateError, TemplateProblem
from tether.shared.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = """{{ bos_token }}{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}
{% if loop.index0 > 8 %}{% break %}{% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}{% else %}{{ message['content'] | trim }}{% endif %}<|eot_id|>{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}{{ {'n': messages | length, 'q': '<&>'} | tojson }}"""  # noqa: E501
MESSAGES = [
    {"role": "user", "content": 'Hello <there> & "you" — ünïcode'},
    {"role": "assistant", "content": "  Hi!  "},
    {"role": "user", "content": "Write <|im_end|> literally?"},
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    base = Tokenizer.train(texts=["Hello there, you. Write it literally; system user assistant.\n"] * 30,
                           vocab_size=300)  # fmt: skip
    backend = tokenizers.Tokenizer.from_str(base.to_json())
    backend.add_special_tokens(SPECIALS)
    return Tokenizer.from_tokenizers(backend)


def model_dir(tmp_path, tokenizer, config: dict, generation: dict | None = None):
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"} | config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def transformers_render(path, messages) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return text, list(ids)


@pytest.mark.parametrize(
    "config",
    [
        {"chat_template": CHATML, "eos_token": "<|im_end|>"},
        {"chat_template": LLAMA3, "eos_token": "<|eot_id|>", "bos_token": {
            "__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}},  # the form older transformers wrote
    ],
    ids=["chatml", "llama3"],
)  # fmt: skip
def test_renders_and_encodes_as_transformers(tmp_path, tokenizer, config):
    path = model_dir(tmp_path, tokenizer, config)
    fmt = ChatFormat.from_model_dir(path, tokenizer)
    assert not fmt.builtin
    want_text, want_ids = transformers_render(path, MESSAGES)
    text = fmt.render(MESSAGES)
    assert text == want_text
    assert fmt.encode(text) == want_ids
    eos = config["eos_token"]
    assert len(tokenizer.encode(eos)) > 1 and len(fmt.encode(eos)) == 1  # special text: plain text there, an id here
    assert fmt.stop_ids == {tokenizer.eos_id, fmt.encode(eos)[0]}
    assert fmt.hidden_ids >= set(fmt.encode("".join(SPECIALS)))


def test_raise_exception_is_a_typed_refusal(tmp_path, tokenizer):
    fmt = ChatFormat.from_model_dir(model_dir(tmp_path, tokenizer, {"chat_template": LLAMA3}), tokenizer)
    with pytest.raises(ChatTemplateError, match="must alternate") as e:
        fmt.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.problem == TemplateProblem.REFUSED
    broken = ChatFormat("{% for %}", {}, tokenizer)
    with pytest.raises(ChatTemplateError, match="compile") as e:
        broken.render(MESSAGES)
    assert e.value.problem == TemplateProblem.SYNTAX and "\n" not in str(e.value)
    failing = ChatFormat("{{ messages[0]['content'] + 1 }}{{ raise_exception('two\nlines') }}", {}, tokenizer)
    with pytest.raises(ChatTemplateError) as e:  # template code that fails on the messages refuses them too
        failing.render(MESSAGES)
    assert e.value.problem == TemplateProblem.REFUSED and "TypeError" in str(e.value)
    with pytest.raises(ChatTemplateError, match="two lines") as e:  # one line, whatever the template says
        failing.render([{"role": "user", "content": 1}])


def test_builtin_template_for_tethers_own_models(tmp_path, tokenizer):
    fmt = ChatFormat.from_model_dir(model_dir(tmp_path, tokenizer, {}), tokenizer)
    assert fmt.builtin and fmt.template == BUILTIN_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert fmt.render(messages) == "<|endoftext|>system: Be brief.\nuser: Hi\nassistant:"
    assert fmt.encode(fmt.render(messages))[0] == tokenizer.eos_id  # a fresh document, as the corpora separate them
    assert fmt.stop_ids == {tokenizer.eos_id}
    replied = [*messages, {"role": "assistant", "content": " Hello."}, {"role": "user", "content": "More"}]
    assert fmt.render(replied) == "<|endoftext|>system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: More\nassistant:"


@pytest.mark.parametrize("reply", [" x = 1", "\n    return x", "x", "  two spaces\n", ""])
def test_a_reply_sent_back_as_generated_renders_what_the_model_saw_and_wrote(tokenizer, reply):
    """The model wrote `reply` straight after the generation prompt: the next turn's rendering holds exactly that
    text, so a chat extends its tokens and an HTTP client's history means what the model meant."""
    fmt = ChatFormat.builtin_for(tokenizer)
    turn = [{"role": "user", "content": "Hi"}]
    seen = fmt.render(turn)
    after = fmt.render([*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}])
    assert after.startswith(seen + reply + "\n") and after.endswith("\nuser: again\nassistant:")


def test_where_templates_and_stop_ids_come_from(tmp_path, tokenizer):
    listed = {"chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "D"}]}
    assert ChatFormat.from_model_dir(model_dir(tmp_path, tokenizer, listed), tokenizer).render(MESSAGES) == "D"
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatFormat.from_model_dir(tmp_path, tokenizer).render(MESSAGES) == "J3"
    generation = {"eos_token_id": [5, 6]}
    fmt = ChatFormat.from_model_dir(model_dir(tmp_path, tokenizer, {"eos_token": "<|eot_id|>"}, generation), tokenizer)
    assert fmt.stop_ids >= {5, 6, tokenizer.eos_id}


def test_every_end_of_text_id_stops_and_travels_to_an_edge(tmp_path, tokenizer):
    """A model whose configs name several end-of-text ids (Llama-3 instruct: `<|end_of_text|>` and `<|eot_id|>`):
    each one stops, on the server (Tokenizer.from_pretrained knows them all) and at an edge, whose tokenizer comes
    from tokenizer.json alone and knows none of the model folder's configs."""
    eot, im_end = tokenizer.encode("x")[0], ChatFormat(CHATML, {}, tokenizer).encode("<|im_end|>")[0]
    path = model_dir(tmp_path, tokenizer, {"chat_template": CHATML}, {"eos_token_id": [eot, 10**9]})
    (path / "config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, im_end]}))
    served = Tokenizer.from_pretrained(path)
    assert served.eos_ids == (tokenizer.eos_id, im_end, eot)  # 10**9 is outside the vocabulary: left out
    for fmt in (ChatFormat.from_model_dir(path, served), ChatFormat.builtin_for(served)):
        assert fmt.stop_ids == {tokenizer.eos_id, im_end, eot}
        edge = ChatFormat.from_json(fmt.to_json(), Tokenizer.from_json(served.to_json()))
        assert edge.stop_ids == fmt.stop_ids


def test_json_form_round_trips_and_is_checked(tmp_path, tokenizer):
    fmt = ChatFormat.from_model_dir(model_dir(tmp_path, tokenizer, {"chat_template": CHATML}), tokenizer)
    again = ChatFormat.from_json(fmt.to_json(), tokenizer)
    assert again == fmt and again.render(MESSAGES) == fmt.render(MESSAGES) and again.stop_ids == fmt.stop_ids
    for bad in ({"template": 3, "specials": {}}, {"template": "x", "specials": {"bos_token": 1}},
                {"template": "x", "specials": {}, "extra_stop_ids": [10**9]},
                {"template": "x", "specials": {}, "extra_stop_ids": [True]}):  # fmt: skip
        with pytest.raises(ChatTemplateError) as e:
            ChatFormat.from_json(json.dumps(bad), tokenizer)
        assert e.value.problem == TemplateProblem.FORMAT


@pytest.mark.parametrize("text", ["[1, 2]", "3", "null", '"a template"', "true", "{not json", "", "[" * 100_000])
def test_json_that_is_not_a_chat_formats_object_is_a_typed_refusal(tokenizer, text):
    """It comes over the network: anything but an object is refused as a ChatTemplateError, never AttributeError or
    a JSON parser's own error, in one line."""
    with pytest.raises(ChatTemplateError) as e:
        ChatFormat.from_json(text, tokenizer)
    assert e.value.problem == TemplateProblem.FORMAT and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value) and len(str(e.value)) <= 500


def test_importing_leaves_torch_and_grpc_out():
    code = "import sys, tether.shared.chat_template, tether.shared.openai_api; print('torch' in sys.modules, 'grpc' in sys.modules)"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
