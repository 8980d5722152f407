"""Hostile chat templates (tether.shared.template_sandbox, under tether.shared.chat_template): memory, time and
output are bounded in a worker process, each past its bound a typed ChatTemplateError (LIMIT), the worker replaced
and the next render served; a template nested past the compiler's stack does not compile (SYNTAX) instead of
crashing anything; over HTTP, such a template is the request's 400.

The time bound is exercised by a template that would run for hours, so the bound always ends it first."""

import asyncio
import sys
import threading

import httpx
import pytest
import tokenizers

from tether.shared.chat_template import ChatFormat, ChatTemplateError, TemplateProblem
from tether.shared.openai_api import Sampling, Tokens
from tether.shared.openai_app import HttpConfig, HttpServer, OpenAIApp
from tether.shared.template_sandbox import RenderLimits, TemplateSandbox
from tether.shared.tokenizer import Tokenizer

BOUND_S = 60
MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
HOURS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"  # 100 M characters, 1 KB at a time


@pytest.fixture(scope="module")
def sandbox():
    box = TemplateSandbox(RenderLimits(timeout_s=1.0, memory_bytes=768 << 20, max_output_chars=1 << 20, workers=1))
    yield box
    box.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    base = Tokenizer.train(texts=["Hello there, you. user assistant.\n"] * 30, vocab_size=300)
    return Tokenizer.from_tokenizers(tokenizers.Tokenizer.from_str(base.to_json()))


@pytest.mark.parametrize(
    "template,why",
    [
        pytest.param("{{ 'x' * 10**10 }}", "memory", marks=pytest.mark.skipif(sys.platform != "linux",
                                                                            reason="RLIMIT_AS is Linux's")),
        (HOURS, "took over"),
        (HUGE, "output is over"),
    ],
    ids=["memory", "time", "output"],
)  # fmt: skip
def test_a_template_past_a_bound_is_a_limit_and_the_next_render_is_served(sandbox, template, why):
    with pytest.raises(ChatTemplateError, match=why) as e:
        sandbox.render(template, MESSAGES)
    assert e.value.problem == TemplateProblem.LIMIT and "\n" not in str(e.value)
    assert sandbox.render("{{ messages[0]['content'] }}!", MESSAGES) == "hi!"


def test_a_template_nested_past_the_compilers_stack_does_not_compile(sandbox):
    with pytest.raises(ChatTemplateError) as e:
        sandbox.render("{% if 1 %}" * 5000 + "{% endif %}" * 5000, MESSAGES)
    assert e.value.problem == TemplateProblem.SYNTAX
    assert sandbox.render("ok", MESSAGES) == "ok"


def test_chat_format_renders_untrusted_templates_under_the_default_bounds(tokenizer):
    with pytest.raises(ChatTemplateError, match="output is over") as e:
        ChatFormat(HUGE * 2, {}, tokenizer).render([{"role": "user", "content": "hi"}])
    assert e.value.problem == TemplateProblem.LIMIT


class Backend:
    drafts_offline = False
    model_id = "m"
    max_context, max_prompt_tokens, max_new_tokens = 512, 256, 16

    def __init__(self, chat: ChatFormat):
        self.chat = chat

    async def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int):
        yield Tokens([5])


def test_over_http_a_template_past_its_bounds_is_the_requests_400(tokenizer):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = HttpConfig(port=0)
    server = HttpServer(OpenAIApp(Backend(ChatFormat(HUGE * 2, {}, tokenizer)), config), config)
    try:
        url = f"http://127.0.0.1:{server.start(loop)}"
        body = {"messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=BOUND_S)
        assert r.status_code == 400
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("messages", "invalid_request")
        assert httpx.get(url + "/health", timeout=BOUND_S).status_code == 200
    finally:
        server.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(BOUND_S)
