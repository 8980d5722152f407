"""The two-sample chi-square test the sampling tests share: do two samples of tokens come from one distribution?"""

import torch


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of two samples of tokens: categories seen at least 10 times in both together
    (5 expected per cell), the rest pooled; returns the p-value."""
    pooled = {}
    for t in a + b:
        pooled[t] = pooled.get(t, 0) + 1
    cats = sorted(t for t, c in pooled.items() if c >= 10)
    counts = torch.tensor([[sum(x == c for x in s) for c in cats] + [sum(x not in cats for x in s)] for s in (a, b)],
                          dtype=torch.float64)  # fmt: skip
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
