"""The edge session's text record (tether.client.session_text): its writers keep prompt, tokens, tags and the verified
length consistent, and a resync's verify tags exactly the offline tokens it kept, telling each run of them.

    .venv/bin/python -m pytest -q tests/client/test_session_text.py
"""

from tether.client.session_text import SessionText

PROMPT = [5, 6, 7]


def text_with(tokens: list[int], tags: list[str], verified: int) -> SessionText:
    text = SessionText()
    text.start(PROMPT)
    for token, tag in zip(tokens, tags, strict=True):
        text.append([token], tag)
    text.adopt(verified)
    return text


def test_a_generation_starts_from_its_prompt_and_appends_tagged_tokens():
    text = SessionText()
    text.start(PROMPT)
    text.append([1, 2], "verified")
    text.append([3], "offline")
    assert text.sequence == [*PROMPT, 1, 2, 3] and text.tags == ["verified", "verified", "offline"]
    assert text.verified == 0
    text.start([*PROMPT, 1, 2, 9], verified=4)  # a chat's next turn over a session that holds 4 positions
    assert (text.prompt, text.tokens, text.tags, text.verified) == ([*PROMPT, 1, 2, 9], [], [], 4)


def test_verify_tags_the_offline_tokens_it_keeps_and_returns_their_runs():
    # Generated: v o o v o o o; the root (index 0) was verified at position 3, the rest came since.
    text = text_with([1, 2, 3, 4, 5, 6, 7], ["verified", "offline", "offline", "verified"] + ["offline"] * 3, 4)
    assert text.verify(9) == [(1, 2), (4, 2)]  # kept through generated index 5: two runs of offline tokens
    assert text.verified == 9
    assert text.tags == ["verified"] * 6 + ["offline"]
    assert text.verify(9) == []  # nothing new
    assert text.verify(11) == [(6, 1)]  # past the text's end: only the tokens it holds


def test_adopt_moves_the_verified_length_and_changes_no_tag():
    text = text_with([1, 2], ["verified", "offline"], 3)
    text.adopt(5)
    assert text.verified == 5 and text.tags == ["verified", "offline"]


def test_retract_takes_back_the_last_tokens_and_restore_starts_over_unverified():
    text = text_with([1, 2, 3], ["verified", "offline", "offline"], 4)
    text.retract(2)
    assert (text.tokens, text.tags) == ([1], ["verified"])
    text.restore([9], [8, 7], ["verified", "offline"])
    assert (text.sequence, text.tags, text.verified) == ([9, 8, 7], ["verified", "offline"], 0)
