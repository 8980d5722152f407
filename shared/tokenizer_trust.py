"""What a tokenizer.json from the other end may hold before the `tokenizers` library loads it: bounded size and
nesting, and regular expressions that cannot backtrack for ever.

Why: the library runs the regexes of a tokenizer's normalizer, pre-tokenizer and decoder (Split, Replace) with
Oniguruma, which backtracks; a pattern such as `(a+)+$` on a long run of `a`s hits Oniguruma's retry limit, and the
library turns that error into a Rust panic (pyo3's PanicException, a BaseException: a traceback, past
`except Exception`). So a server's tokenizer is refused in one line when a pattern is longer than
MAX_PATTERN_CHARS, uses a backreference, repeats a variable number of times a group that itself does or
alternates (`(a+)+`, `(a|aa)*`: the constructs whose backtracking grows exponentially), or counts past MAX_REPEAT.
Real tokenizers' patterns (GPT-2's ByteLevel, Llama 3's, Qwen's and GPT-4o's Split) use none of these. Patterns
that pass may still backtrack polynomially (`a*a*a*$`) until Oniguruma's retry limit stops them: what fails
inside the library while encoding is caught by tether.shared.tokenizer.Tokenizer and reported as
TokenizerFailed, one line (Rust's panic hook still prints its own message on stderr).

Contract: `check_tokenizer_json(text)` -> the parsed JSON object, or ValueError (one line) for text over
MAX_JSON_CHARS, JSON that does not parse or nests deeper than MAX_DEPTH, or a refused pattern ({"Regex": ...}
anywhere in it). `check_pattern(pattern)` -> None or ValueError, for one pattern.

    check_tokenizer_json(received_text)   # then tokenizers.Tokenizer.from_str(received_text)

Tests: tests/client/test_hostile_tokenizer.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_JSON_CHARS = 64 << 20  # Llama 3's tokenizer.json is ~9 MB
MAX_DEPTH = 32  # a Sequence of Sequences of ... normalizers
MAX_PATTERN_CHARS = 1024  # Llama 3's pattern has ~150
MAX_REPEAT = 1000  # the largest count a {n,m} may name
_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")


def check_tokenizer_json(text: str) -> dict:
    """See the module docstring."""
    if len(text) > MAX_JSON_CHARS:
        raise ValueError(f"tokenizer.json is over {MAX_JSON_CHARS >> 20} MiB")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"tokenizer.json is not JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ValueError("tokenizer.json is not a JSON object")
    _walk(data, 0)
    return data


def _walk(node, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"tokenizer.json nests deeper than {MAX_DEPTH}")
    if isinstance(node, dict):
        pattern = node.get("Regex")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise ValueError("a tokenizer regex is not a string")
            check_pattern(pattern)
        for key, value in node.items():
            if key not in ("vocab", "merges"):  # the large parts, plain tokens
                _walk(value, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _walk(value, depth + 1)


@dataclass
class _Group:
    repeats: bool = False  # holds a quantifier that repeats a variable number of times (*, +, {n,}, {n,m} with m > n)
    alternates: bool = False  # holds a | of its own


def check_pattern(pattern: str) -> None:
    """Refuse a regex that may backtrack exponentially (module docstring); a plain scan of Oniguruma's syntax."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a tokenizer regex is over {MAX_PATTERN_CHARS} characters")
    stack = [_Group()]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i = _escape(pattern, i)
            _quantified(pattern, i, stack, inner=None)
            i = _skip_quantifier(pattern, i)
            continue
        if c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            i = _group_start(pattern, i)
            stack.append(_Group())
            continue
        elif c == ")":
            if len(stack) == 1:
                raise ValueError("a tokenizer regex closes a group it never opened")
            inner = stack.pop()
            i += 1
            _quantified(pattern, i, stack, inner=inner)
            i = _skip_quantifier(pattern, i)
            continue
        elif c == "|":
            stack[-1].alternates = True
            i += 1
            continue
        else:
            i += 1
        _quantified(pattern, i, stack, inner=None)
        i = _skip_quantifier(pattern, i)
    if len(stack) != 1:
        raise ValueError("a tokenizer regex leaves a group open")


def _escape(p: str, i: int) -> int:
    """The index after the escape at i; refuses backreferences."""
    if i + 1 >= len(p):
        raise ValueError("a tokenizer regex ends in a lone backslash")
    e = p[i + 1]
    if e in "123456789" or (e == "k" and i + 2 < len(p) and p[i + 2] in "<'") or e == "g":
        raise ValueError("a tokenizer regex uses a backreference or a subexpression call")
    if e in "pPxuN" and i + 2 < len(p) and p[i + 2] == "{":
        end = p.find("}", i + 2)
        if end < 0:
            raise ValueError("a tokenizer regex has an unclosed escape")
        return end + 1
    return i + 2


def _class_end(p: str, i: int) -> int:
    """The index after the character class opening at i (classes nest in Oniguruma)."""
    depth, i = 0, i
    while i < len(p):
        c = p[i]
        if c == "\\":
            i = _escape(p, i)
            continue
        if c == "[":
            depth += 1
            if i + 1 < len(p) and p[i + 1] == "]":
                i += 1  # a ] first in a class is a literal
        elif c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("a tokenizer regex leaves a character class open")


def _group_start(p: str, i: int) -> int:
    """The index of a group's first atom: after `(`, `(?:`, `(?i:`, `(?=`, `(?<!`, `(?<name>`..."""
    i += 1
    if i >= len(p) or p[i] != "?":
        return i
    i += 1
    if i < len(p) and p[i] in "=!>":
        return i + 1
    if i < len(p) and p[i] == "<":
        if i + 1 < len(p) and p[i + 1] in "=!":
            return i + 2
        end = p.find(">", i)
        if end < 0:
            raise ValueError("a tokenizer regex has an unclosed group name")
        return end + 1
    while i < len(p) and (p[i].isalpha() or p[i] == "-"):
        i += 1  # inline flags: (?i) ends here at its ), (?i: goes on after the :
    return i + 1 if i < len(p) and p[i] == ":" else i


def _quantifier(p: str, i: int) -> tuple[int, bool]:
    """(the index after a quantifier at i, whether it repeats a variable number of times); (i, False) when there is
    none."""
    if i >= len(p):
        return i, False
    if p[i] in "*+":
        return i + 1, True
    if p[i] == "?":
        return i + 1, False
    m = _COUNT.match(p, i)
    if m is None or not (m.group(1) or m.group(3)):
        return i, False  # a literal {
    low, comma, high = m.group(1), m.group(2), m.group(3)
    counts = [int(x) for x in (low, high) if x]
    if any(x > MAX_REPEAT for x in counts):
        raise ValueError(f"a tokenizer regex counts past {MAX_REPEAT}")
    return m.end(), bool(comma) and (not high or int(high) > int(low or 0))  # {n} is a fixed width, no choice


def _quantified(p: str, i: int, stack: list[_Group], inner: _Group | None) -> None:
    """Note a quantifier after the atom that ends at i; refuse one that repeats a group that repeats or alternates."""
    _, repeats = _quantifier(p, i)
    if inner is not None:
        if repeats and (inner.repeats or inner.alternates):
            raise ValueError(
                "a tokenizer regex repeats a group that itself repeats or alternates (catastrophic backtracking)"
            )
        stack[-1].repeats |= inner.repeats
    stack[-1].repeats |= repeats


def _skip_quantifier(p: str, i: int) -> int:
    """After a quantifier and its lazy (?) or possessive (+) mark, if there is one."""
    end, _ = _quantifier(p, i)
    if end != i and end < len(p) and p[end] in "?+":
        end += 1
    return end
