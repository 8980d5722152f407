"""A server's tokenizer whose regex backtracks for ever: refused in one line when it arrives
(tether.shared.tokenizer_trust, through Tokenizer.from_json and pairing's check_tokenizer), and what still fails
inside the `tokenizers` library while encoding (a Rust panic, pyo3's PanicException: a BaseException) is a
TokenizerFailed, a ValueError in one line, never a traceback past `except Exception`."""

import json

import pytest
from toy_models import toy_model_dir

from tether.client.errors import Problem, ServerDataError
from tether.client.pairing_checks import check_tokenizer
from tether.shared.tokenizer import Tokenizer, TokenizerFailed
from tether.shared.tokenizer_trust import check_pattern, check_tokenizer_json
from tether.v1 import tether_pb2 as pb

TOKENIZER = toy_model_dir()
# Patterns real tokenizers ship (Llama 3's, Qwen2's, GPT-4o's Split) and a few of the library's usual forms.
REAL = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?<=\d)(?=(\d{3})+$)",  # a group of a fixed width, repeated: no choice inside it
    r"[[:alpha:]]+|[\]\[]+|\{|\}",
]
CATASTROPHIC = {
    "nested plus": r"(a+)+$",
    "nested star in a non-capturing group": r"(?:\s*\w*)*$",
    "alternation repeated": r"(a|aa)*b",
    "counted repeat of a repeat": r"(x+x+){2,}y",
    "backreference": r"(a)\1",
    "named backreference": r"(?<q>a)\k<q>",
    "count past the bound": r"a{100000}",
    "over long": "a" * 5000,
    "unbalanced": r"(a",
}


def with_split(pattern: str) -> str:
    """The shipped tokenizer.json with a Split pre-tokenizer of `pattern` in front of its own."""
    d = json.loads(Tokenizer.from_pretrained(TOKENIZER).to_json())
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, d["pre_tokenizer"]]}
    return json.dumps(d)


@pytest.mark.parametrize("pattern", REAL)
def test_the_patterns_real_tokenizers_ship_pass(pattern):
    check_pattern(pattern)


@pytest.mark.parametrize("case", list(CATASTROPHIC))
def test_a_pattern_that_may_backtrack_for_ever_is_refused_in_one_line(case):
    with pytest.raises(ValueError) as e:
        check_pattern(CATASTROPHIC[case])
    assert "\n" not in str(e.value)


def test_a_tokenizer_with_a_catastrophic_regex_is_refused_when_it_arrives():
    text = with_split(r"(a+)+$")
    with pytest.raises(ValueError, match="repeats a group"):
        Tokenizer.from_json(text)
    tok = Tokenizer.from_pretrained(TOKENIZER)
    info = pb.ModelInfo(tokenizer_sha256=tok.sha256)
    with pytest.raises(ServerDataError) as e:
        check_tokenizer(text.encode(), info)
    assert e.value.problem == Problem.TOKENIZER and "\n" not in str(e.value)
    assert check_tokenizer(tok.to_json().encode(), info).sha256 == tok.sha256  # the honest one still pairs


def test_deep_or_oversize_json_is_refused():
    with pytest.raises(ValueError, match="nests deeper"):
        check_tokenizer_json('{"a": ' * 40 + "1" + "}" * 40)
    with pytest.raises(ValueError, match="not JSON"):
        check_tokenizer_json("[" * 100_000)


def test_a_panic_inside_the_library_is_one_line_not_a_traceback():
    """Adjacent repeats pass the check (no nesting) yet blow Oniguruma's retry limit on a long run: the library
    panics, and encode reports it as TokenizerFailed; the tokenizer goes on encoding other text."""
    tok = Tokenizer.from_json(with_split(r"a*a*a*a*a*a*$"))
    with pytest.raises(TokenizerFailed) as e:
        tok.encode("a" * 400 + "!")
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"
