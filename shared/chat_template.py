"""Chat templates: turning OpenAI-style `messages` into the prompt a model was trained to continue.

Contract:
- `ChatFormat.from_model_dir(dir, tokenizer)` reads the model's chat template the way transformers does: the
  `chat_template` of tokenizer_config.json (a string, or a list of named templates of which "default" is taken) or a
  chat_template.jinja file beside it, with its special tokens (bos_token, eos_token, unk_token, pad_token, as
  strings or {"content": ...}). A directory without one gets `BUILTIN_TEMPLATE`, the template of tether's own
  models, which were trained on plain text (Python sources) and have no chat format of their own:

      <|endoftext|>system: {content}
      user: {content}
      assistant:{content}
      user: {content}
      assistant:

  after the end-of-text token (the document separator tether's corpora use, so a conversation starts a fresh
  document) a line per message, then "assistant:" for the model to continue. System and user messages read
  "role: content"; an assistant message is "assistant:" + content exactly, with no space put in: the model wrote
  its reply straight after "assistant:" (usually starting with a space or a newline), so a reply sent back as it
  was generated renders exactly the text the model saw and wrote, and a chat's next turn extends its tokens.
- `render(messages)` renders as transformers' `apply_chat_template(..., add_generation_prompt=True)`: a sandboxed
  Jinja environment with trim_blocks and lstrip_blocks, loop controls, `{% generation %}` blocks, a `tojson` filter
  that does not escape HTML, `raise_exception(message)` and `strftime_now(format)`, and the special tokens as
  variables. A template's own refusal (raise_exception, a malformed conversation) raises `ChatTemplateError`.
  Any template but BUILTIN_TEMPLATE is untrusted code (a model's files, or at the edge the server's word): it is
  rendered in a worker process under bounds of time, memory and output (tether.shared.template_sandbox, which
  says why a thread cannot bound it), and past them raises ChatTemplateError (LIMIT). Blocking for up to
  RenderLimits.timeout_s: callers on an event loop run it on a worker thread. BUILTIN_TEMPLATE, whose cost is
  linear in the messages, renders in this process.
- `encode(text)` tokenizes a rendered prompt as transformers does for a chat: the text of every added token
  (`<|im_start|>` ...) becomes that token's id, everything between is encoded as the library encodes it beside
  them (a Metaspace pre-tokenizer with prepend_scheme "first" prepends no "▁" after `<s>`), no BOS is added (a
  template that wants one writes `{{ bos_token }}`).
- `surely_over(text, max_tokens)`: True when the text is too long to encode to max_tokens tokens whatever it
  holds (its byte length against `max_token_bytes`, the longest vocabulary entry): a prompt far over the limit is
  refused without tokenizing it.
- `stop_ids`: the ids that end a generation: every end-of-text id of the tokenizer (Tokenizer.eos_ids: a Llama-3
  instruct model's `<|end_of_text|>` and `<|eot_id|>`), the template's eos_token and the eos_token_id of
  generation_config.json (an int or a list). `from_model_dir` keeps the tokenizer's and generation_config.json's
  in `extra_stop_ids`, so the format sent to an edge stops where the server's does whatever the edge's tokenizer
  knows. `hidden_ids`: the special tokens, left out of the text
  a server returns (as vLLM's skip_special_tokens does).
- `to_json()` / `from_json(text, tokenizer)`: the format as a small JSON object (template, special tokens), so a
  client that only has the tokenizer (the edge) renders exactly what the server would. The text comes over the
  network: anything but such an object (not JSON, not an object, fields of the wrong type or size) is refused.
- Every refusal is a `ChatTemplateError` (a ValueError) whose `problem` (TemplateProblem) says which: FORMAT (a
  chat format's JSON that is malformed), SYNTAX (a template that does not compile), REFUSED (the template refused
  the conversation), LIMIT (rendering it ran past a bound). Callers branch on it, never on the message, which is
  one line.

Torch- and gRPC-free: the server's HTTP API and the edge client's both use it.

    fmt = ChatFormat.from_model_dir("deploy/models/target", tokenizer)
    ids = fmt.encode(fmt.render([{"role": "user", "content": "Hello"}]))
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.shared.template_sandbox import (
    ChatTemplateError,
    TemplateProblem,
    compile_template,
    default_sandbox,
    environment,
    render_compiled,
)
from tether.shared.tokenizer import EOS_TOKEN, Tokenizer

BUILTIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "assistant:{{ message['content'] }}\n{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template longer than this is not one (they run to a few KB)
__all__ = ["BUILTIN_TEMPLATE", "ChatFormat", "ChatTemplateError", "TemplateProblem"]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken-like {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or [{"name", "template"}] of which "default" is used."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class ChatFormat:
    template: str  # the Jinja chat template
    specials: dict[str, str]  # bos_token, eos_token, ... -> their text (the template's variables)
    tokenizer: Tokenizer = field(repr=False, compare=False)  # the model's tokenizer
    builtin: bool = False  # True: the model has no template of its own and BUILTIN_TEMPLATE is used
    extra_stop_ids: tuple[int, ...] = ()  # end-of-text ids carried to an edge (from_model_dir: the tokenizer's too)

    # ---- loading ----------------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, tokenizer: Tokenizer) -> ChatFormat:
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        template = _pick_template(config.get("chat_template"))
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        specials = {k: t for k in SPECIAL_NAMES if (t := _token_text(config.get(k))) is not None}
        eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        listed = [i for i in (eos if isinstance(eos, list) else [eos]) if type(i) is int]
        # Every end-of-text id travels in the format: an edge's tokenizer comes without the model folder's configs.
        # Ids outside the vocabulary are left out, as an edge would refuse the format for them (from_json).
        extra = tuple(dict.fromkeys(i for i in [*tokenizer.eos_ids, *listed] if 0 <= i < tokenizer.vocab_size))
        if template is None:
            return cls.builtin_for(tokenizer, extra)
        return cls(template, specials, tokenizer, extra_stop_ids=extra)

    @classmethod
    def builtin_for(cls, tokenizer: Tokenizer, extra_stop_ids: tuple[int, ...] = ()) -> ChatFormat:
        """BUILTIN_TEMPLATE, with the tokenizer's (first) end-of-text as bos_token and eos_token; every end-of-text
        id of the tokenizer, then `extra_stop_ids`, stop a generation."""
        eos = _read_added(tokenizer)[0].get(tokenizer.eos_id, EOS_TOKEN) if tokenizer.eos_id is not None else ""
        stops = tuple(dict.fromkeys([*tokenizer.eos_ids, *extra_stop_ids]))
        return cls(
            BUILTIN_TEMPLATE, {"bos_token": eos, "eos_token": eos}, tokenizer, builtin=True, extra_stop_ids=stops
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "template": self.template,
                "specials": self.specials,
                "builtin": self.builtin,
                "extra_stop_ids": list(self.extra_stop_ids),
            }
        )

    @classmethod
    def from_json(cls, text: str, tokenizer: Tokenizer) -> ChatFormat:
        """The format a server described with to_json; ChatTemplateError (FORMAT) when it is not one: it came over
        the network, so nothing in it is taken on trust."""

        def refuse(what: str) -> ChatTemplateError:
            return ChatTemplateError(TemplateProblem.FORMAT, f"chat format: {what}")

        if not isinstance(text, str) or len(text) > 2 * MAX_TEMPLATE_CHARS:
            raise refuse("the text must be a string of at most 2 MiB")
        try:
            data = json.loads(text)
        except ValueError as e:  # RecursionError aside, json raises only this (JSONDecodeError) on bad text
            raise refuse(f"not JSON ({e})") from None
        except RecursionError:
            raise refuse("JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise refuse(f"not a JSON object but {text[:40]!r}")
        template, specials = data.get("template"), data.get("specials")
        extra = data.get("extra_stop_ids", [])
        if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
            raise refuse("the template must be a string of at most 1 MiB")
        if not isinstance(specials, dict) or not all(isinstance(v, str) for v in specials.values()):
            raise refuse("specials must map names to strings")
        ids = isinstance(extra, list) and all(type(i) is int and 0 <= i < tokenizer.vocab_size for i in extra)
        if not ids:
            raise refuse("extra_stop_ids must be token ids of the vocabulary")
        return cls(
            template,
            {k: specials[k] for k in SPECIAL_NAMES if k in specials},
            tokenizer,
            builtin=data.get("builtin") is True,
            extra_stop_ids=tuple(extra),
        )

    # ---- rendering and encoding -------------------------------------------------------------------------

    @functools.cached_property
    def _added(self) -> tuple[dict[int, str], dict[int, str]]:
        return _read_added(self.tokenizer)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
            **self.specials,
        }
        if self.template == BUILTIN_TEMPLATE:  # tether's own: trusted, and linear in the messages
            return render_compiled(_builtin_compiled(), context)
        return default_sandbox().render(self.template, context)

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt: added tokens' text as their ids, the rest as plain text encoded beside
        them as the library does (Tokenizer.encode_with_specials)."""
        return self.tokenizer.encode_with_specials(text)

    def surely_over(self, text: str, max_tokens: int) -> bool:
        """True when `text` cannot encode to `max_tokens` tokens or fewer, told from its length alone: a token stands
        for at most `max_token_bytes` bytes, and a normalizer may shrink the text (NFC, say) by a factor of 4 at
        most. Lets a server refuse a megabyte prompt without spending seconds tokenizing it."""
        bound = max_tokens * self.max_token_bytes * 4
        return len(text) > bound or len(text.encode("utf-8", "surrogatepass")) > bound  # bytes >= characters

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for: the UTF-8 length of the longest vocabulary entry (byte-level
        and SentencePiece entries spell at least the bytes they stand for; byte-fallback ones more)."""
        data = json.loads(self.tokenizer.to_json())
        vocab = (data.get("model") or {}).get("vocab") or {}
        entries = vocab.keys() if isinstance(vocab, dict) else [v[0] for v in vocab if isinstance(v, list) and v]
        added = [str(e.get("content", "")) for e in data.get("added_tokens") or []]
        return max([len(str(t).encode("utf-8", "replace")) for t in [*entries, *added]] or [1], default=1)

    @property
    def stop_ids(self) -> frozenset[int]:
        ids = set(self.extra_stop_ids) | set(self.tokenizer.eos_ids)
        eos_text = self.specials.get("eos_token")
        ids |= {i for i, t in self._added[0].items() if eos_text and t == eos_text}
        return frozenset(ids)

    @property
    def hidden_ids(self) -> frozenset[int]:
        return frozenset(self._added[1])


def _read_added(tokenizer: Tokenizer) -> tuple[dict[int, str], dict[int, str]]:
    """The tokenizer's added tokens as id -> text: all of them, and those flagged special."""
    entries = json.loads(tokenizer.to_json()).get("added_tokens") or []
    every = {int(e["id"]): str(e["content"]) for e in entries}
    return every, {int(e["id"]): str(e["content"]) for e in entries if e.get("special")}


@functools.cache
def _builtin_compiled():
    return compile_template(environment(), BUILTIN_TEMPLATE)
