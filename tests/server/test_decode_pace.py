"""What a token of a Generate stream costs now (tether.server.decode_pace.DecodePace): nothing before a chunk was
measured; each figure an EWMA of its chunks' seconds per token; the batched figure for a stream that would decode
beside others (the lone one while none was batched), the lone figure for one that would decode alone, so a busy
past is not advertised to an idle server's next client.

    .venv/bin/python -m pytest -q tests/server/test_decode_pace.py
"""

import pytest

from tether.server.decode_pace import EWMA_WEIGHT, DecodePace


def test_nothing_is_advertised_before_a_chunk_was_measured():
    pace = DecodePace()
    assert pace.step_s(together=False) == pace.step_s(together=True) == 0.0
    pace.decoded(1.0, 0, alone=True)  # nothing decoded: nothing learnt
    assert pace.step_s(together=False) == 0.0


def test_each_figure_is_an_ewma_of_its_own_chunks():
    pace = DecodePace()
    pace.decoded(0.16, 16, alone=True)
    pace.decoded(0.32, 16, alone=True)
    assert pace.step_s(together=False) == pytest.approx(0.01 + EWMA_WEIGHT * (0.02 - 0.01))
    assert pace.step_s(together=True) == pace.step_s(together=False)  # none batched yet: the lone figure
    pace.decoded(0.3, 1, alone=False)
    assert pace.step_s(together=True) == pytest.approx(0.3)
    assert pace.step_s(together=False) == pytest.approx(0.0125)  # a busy spell leaves the lone figure as it was
