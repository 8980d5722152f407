"""Chat templates: turning OpenAI-style `messages` into the prompt a model was trained to continue.

Contract:
- `ChatFormat.from_model_dir(dir, tokenizer)` reads the model's chat template the way transformers does: the
  `chat_template` of tokenizer_config.json (a string, or a list of named templates of which "default" is taken) or a
  chat_template.jinja file beside it, with its special tokens (bos_token, eos_token, unk_token, pad_token, as
  strings or {"content": ...}). A directory without one gets `BUILTIN_TEMPLATE`, the template of tether's own
  models, which were trained on plain text (Python sources) and have no chat format of their own:

      <|endoftext|>system: {content}
      user: {content}
      assistant:

  one "role: content" line per message after the end-of-text token (the document separator tether's corpora use,
  so a conversation starts a fresh document), then "assistant:" for the model to continue.
- `render(messages)` renders as transformers' `apply_chat_template(..., add_generation_prompt=True)`: a sandboxed
  Jinja environment with trim_blocks and lstrip_blocks, loop controls, `{% generation %}` blocks, a `tojson` filter
  that does not escape HTML, `raise_exception(message)` and `strftime_now(format)`, and the special tokens as
  variables. A template's own refusal (raise_exception, a malformed conversation) raises `ChatTemplateError`.
- `encode(text)` tokenizes a rendered prompt as transformers does for a chat: the text of every added token
  (`<|im_start|>` ...) becomes that token's id, everything between is encoded as plain text, no BOS is added (a
  template that wants one writes `{{ bos_token }}`).
- `stop_ids`: the ids that end a generation: the tokenizer's end-of-text, the template's eos_token and the
  eos_token_id of generation_config.json (an int or a list). `hidden_ids`: the special tokens, left out of the text
  a server returns (as vLLM's skip_special_tokens does).
- `to_json()` / `from_json(text, tokenizer)`: the format as a small JSON object (template, special tokens), so a
  client that only has the tokenizer (the edge) renders exactly what the server would.

Torch- and gRPC-free: the server's HTTP API and the edge client's both use it.

    fmt = ChatFormat.from_model_dir("deploy/models/target", tokenizer)
    ids = fmt.encode(fmt.render([{"role": "user", "content": "Hello"}]))
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.shared.tokenizer import EOS_TOKEN, Tokenizer

BUILTIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
MAX_TEMPLATE_CHARS = 1 << 20  # a chat template longer than this is not one (they run to a few KB)


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or could not render it: the caller's request."""


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
    extra_stop_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id(s)

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
        extra = tuple(i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int))
        if template is None:
            return cls.builtin_for(tokenizer, extra)
        return cls(template, specials, tokenizer, extra_stop_ids=extra)

    @classmethod
    def builtin_for(cls, tokenizer: Tokenizer, extra_stop_ids: tuple[int, ...] = ()) -> ChatFormat:
        """BUILTIN_TEMPLATE, with the tokenizer's end-of-text as bos_token and eos_token."""
        eos = _read_added(tokenizer)[0].get(tokenizer.eos_id, EOS_TOKEN) if tokenizer.eos_id is not None else ""
        return cls(BUILTIN_TEMPLATE, {"bos_token": eos, "eos_token": eos}, tokenizer, builtin=True,
                   extra_stop_ids=extra_stop_ids)  # fmt: skip

    def to_json(self) -> str:
        return json.dumps({"template": self.template, "specials": self.specials, "builtin": self.builtin,
                           "extra_stop_ids": list(self.extra_stop_ids)})  # fmt: skip

    @classmethod
    def from_json(cls, text: str, tokenizer: Tokenizer) -> ChatFormat:
        """The format a server described with to_json (ValueError when malformed: it came over the network)."""
        data = json.loads(text)
        template, specials = data.get("template"), data.get("specials")
        extra = data.get("extra_stop_ids", [])
        if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
            raise ValueError("chat format: the template must be a string of at most 1 MiB")
        if not isinstance(specials, dict) or not all(isinstance(v, str) for v in specials.values()):
            raise ValueError("chat format: specials must map names to strings")
        if not isinstance(extra, list) or not all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in extra):
            raise ValueError("chat format: extra_stop_ids must be token ids of the vocabulary")
        return cls(template, {k: specials[k] for k in SPECIAL_NAMES if k in specials}, tokenizer,
                   builtin=bool(data.get("builtin")), extra_stop_ids=tuple(extra))  # fmt: skip

    # ---- rendering and encoding -------------------------------------------------------------------------

    @functools.cached_property
    def _compiled(self):
        import jinja2

        try:
            return _environment().from_string(self.template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None

    @functools.cached_property
    def _added(self) -> tuple[dict[int, str], dict[int, str]]:
        return _read_added(self.tokenizer)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        import jinja2

        compiled = self._compiled
        try:
            return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                   tools=None, documents=None, **self.specials)  # fmt: skip
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the conversation: {e.message or e}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt: added tokens' text as their ids, the rest as plain text."""
        added = self._added[0]
        if not added:
            return self.tokenizer.encode(text)
        by_text = {t: i for i, t in added.items() if t}
        pattern = "|".join(re.escape(t) for t in sorted(by_text, key=len, reverse=True))
        ids: list[int] = []
        for n, piece in enumerate(re.split(f"({pattern})", text)):
            if n % 2:
                ids.append(by_text[piece])
            elif piece:
                ids += self.tokenizer.encode(piece)
        return ids

    @property
    def stop_ids(self) -> frozenset[int]:
        ids = set(self.extra_stop_ids)
        if self.tokenizer.eos_id is not None:
            ids.add(self.tokenizer.eos_id)
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


def _environment():
    """The Jinja environment transformers renders chat templates in (sandboxed: templates are untrusted code)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
