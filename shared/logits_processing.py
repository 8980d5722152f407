"""Sampling controls and the logits stage of the sampling rule: logit_bias and the repetition, frequency and
presence penalties, one definition computed alike on numpy and torch.

Contract. `SamplingControls` holds every knob of one sequence's sampling (temperature, top_p, top_k, min_p, the
three penalties, logit_bias), checked on construction against the ranges vLLM and OpenAI accept, and against a
vocabulary by `check_vocab`; a bad value raises `ControlError` (a ValueError naming the control in `.control`,
so an API answers 400 / INVALID_ARGUMENT with the parameter's name); `SamplingControls.of(config)` reads them off a
configuration or request that carries them under the same names (`ControlFields`). The processed distribution of a
position, in vLLM's order and with its semantics:

1. logit_bias[id] is added to the token's logit;
2. the repetition penalty r, over every token of the context (prompt and generated): a positive logit is divided
   by r, any other multiplied by r (HF / vLLM);
3. the frequency and presence penalties, over the GENERATED tokens only: logit -= frequency * count, then
   logit -= presence * (count > 0);
4. then tether.shared.sampling's rule: temperature, top-k, top-p, min_p, renormalised. Greedy (temperature 0)
   is the argmax of the processed logits.

Steps 1-3 are a `LogitsProcessing`: the controls with the token counts of the context before the position
(`SamplingControls.processing(context, prompt_len, vocab_size)`, None when they change nothing). `apply_np` is the
numpy form (the edge's onnxruntime drafter, the torch drafters' chains); `ProcessingRows` is the torch form for a
batch of rows, each with its own controls and counts (the verifiers, on the logits' device). Both compute in
float64, op for op the same, so they agree bit for bit on a CPU.

Speculation stays exact because each position is processed with the counts of its own context: a draft node's
context is the sequence through the round's root plus the drafted tokens on its path from the root, so
`processing.after(path_tokens)` (numpy) and `ProcessingRows.after(extra)` (torch) are what verifiers and
drafters use for node after node. Importing this module does not import torch.

    controls = SamplingControls(temperature=0.7, presence_penalty=0.5, logit_bias={13: -100})
    proc = controls.processing(prompt + generated, len(prompt), vocab_size)  # None: nothing to do
    p = probabilities_np(proc.apply_np(logits), controls.temperature, controls.top_p, controls.top_k, controls.min_p)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor

PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI, vLLM)
BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)


class ControlError(ValueError):
    """A sampling control out of its range; `control` is the field's name (e.g. "presence_penalty")."""

    def __init__(self, control: str, message: str):
        super().__init__(message)
        self.control = control


class ControlFields(Protocol):
    """A configuration or request that carries every sampling control under SamplingControls' names, read-only (the
    edge's ClientConfig, `tether-server generate`'s GenerateConfig, the OpenAI API's Sampling): what
    `SamplingControls.of` reads."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_p(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def min_p(self) -> float: ...

    @property
    def presence_penalty(self) -> float: ...

    @property
    def frequency_penalty(self) -> float: ...

    @property
    def repetition_penalty(self) -> float: ...

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...


@dataclass(frozen=True)
class SamplingControls:
    """One sequence's sampling settings (module docstring). logit_bias is given as {token id: bias} or pairs and
    kept as a sorted tuple of (id, bias) pairs, so the controls stay hashable and compare by value."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "logit_bias" and not math.isfinite(getattr(self, f.name)):
                raise ControlError(f.name, f"{f.name} must be a finite number, got {getattr(self, f.name)}")
        if self.temperature < 0:
            raise ControlError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ControlError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise ControlError("top_k", f"top_k must be a whole number >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ControlError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ControlError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ControlError("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias: dict[int, float] = {}
        for token, value in pairs:
            if int(token) != token or token < 0:
                raise ControlError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not (math.isfinite(value) and -BIAS_RANGE <= value <= BIAS_RANGE):
                raise ControlError("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for {token}")
            if int(token) in bias:
                raise ControlError("logit_bias", f"logit_bias names token {token} twice")
            bias[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))
        object.__setattr__(self, "top_k", int(self.top_k))

    @classmethod
    def of(cls, source: ControlFields) -> SamplingControls:
        """The controls a configuration or request carries under these names (ControlError, naming the control,
        for one out of its range)."""
        return cls(
            temperature=source.temperature,
            top_p=source.top_p,
            top_k=source.top_k,
            min_p=source.min_p,
            presence_penalty=source.presence_penalty,
            frequency_penalty=source.frequency_penalty,
            repetition_penalty=source.repetition_penalty,
            logit_bias=source.logit_bias,
        )

    def check_vocab(self, vocab_size: int) -> None:
        """ControlError unless every logit_bias id is a token of a vocabulary of `vocab_size`."""
        outside = [t for t, _ in self.logit_bias if t >= vocab_size]
        if outside:
            raise ControlError("logit_bias", f"logit_bias token {outside[0]} is outside the vocabulary of {vocab_size}")

    @property
    def penalised(self) -> bool:
        """Some penalty is on: the processed logits depend on the context's tokens."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Steps 1-3 change something: greedy is then not the raw logits' argmax."""
        return self.penalised or any(b != 0 for _, b in self.logit_bias)

    def processing(self, context: Sequence[int], prompt_len: int, vocab_size: int) -> LogitsProcessing | None:
        """Steps 1-3 for the position after `context` (the sequence so far: its first `prompt_len` tokens are the
        prompt, the rest generated), or None when they change nothing."""
        if not self.processes_logits:
            return None
        self.check_vocab(vocab_size)
        bias = None
        if self.logit_bias:
            bias = np.zeros(vocab_size, np.float64)
            ids, values = zip(*self.logit_bias, strict=True)
            bias[list(ids)] = values
        ctx = np.asarray(context, dtype=np.int64)
        seen = np.bincount(ctx, minlength=vocab_size)[:vocab_size] > 0  # [V]
        generated = np.bincount(ctx[prompt_len:], minlength=vocab_size)[:vocab_size].astype(np.float64)  # [V]
        return LogitsProcessing(
            bias, self.repetition_penalty, self.frequency_penalty, self.presence_penalty, seen, generated
        )


@dataclass(frozen=True, eq=False)  # arrays have no single truth value
class LogitsProcessing:
    """Steps 1-3 at one position of one sequence: its controls and the counts of the context before it."""

    bias: np.ndarray | None  # [V] float64, or None for no logit_bias
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seen: np.ndarray  # [V] bool: the token occurs in the context (prompt or generated)
    generated: np.ndarray  # [V] float64: how often it was generated

    @property
    def vocab_size(self) -> int:
        return self.seen.shape[0]

    def after(self, tokens: Sequence[int]) -> LogitsProcessing:
        """The processing of the position after these further generated tokens (a draft path)."""
        if len(tokens) == 0:
            return self
        generated = self.generated.copy()
        np.add.at(generated, np.asarray(tokens, dtype=np.int64), 1.0)
        seen = self.seen | (generated > 0)
        return LogitsProcessing(
            self.bias, self.repetition_penalty, self.frequency_penalty, self.presence_penalty, seen, generated
        )

    def apply_np(self, logits: np.ndarray) -> np.ndarray:
        """logits [..., V] -> float64 processed logits [..., V]. Each step runs even when it changes nothing
        (adding 0, dividing by 1), as ProcessingRows does for every row, so the two agree bit for bit."""
        x = np.asarray(logits, dtype=np.float64) + (0.0 if self.bias is None else self.bias)
        r = self.repetition_penalty
        x = np.where(self.seen, np.where(x > 0, x / r, x * r), x)
        x = x - self.frequency_penalty * self.generated
        return x - self.presence_penalty * (self.generated > 0)


@dataclass(frozen=True, eq=False)  # tensors have no single truth value
class ProcessingRows:
    """Steps 1-3 for a batch of B rows (torch), each row with its own controls and counts; a row that processes
    nothing holds zeros and a repetition penalty of 1, which leave its logits unchanged."""

    bias: Tensor  # [B, V] float64
    repetition: Tensor  # [B, 1] float64
    frequency: Tensor  # [B, 1] float64
    presence: Tensor  # [B, 1] float64
    seen: Tensor  # [B, V] bool
    generated: Tensor  # [B, V] float64

    @classmethod
    def stack(cls, rows: Sequence[LogitsProcessing | None], vocab_size: int) -> ProcessingRows:
        """The rows on the CPU (None: a row that processes nothing)."""
        import torch

        B = len(rows)
        bias = torch.zeros(B, vocab_size, dtype=torch.float64)
        seen = torch.zeros(B, vocab_size, dtype=torch.bool)
        generated = torch.zeros(B, vocab_size, dtype=torch.float64)
        scalars = torch.tensor(
            [
                [1.0, 0.0, 0.0] if r is None else [r.repetition_penalty, r.frequency_penalty, r.presence_penalty]
                for r in rows
            ],
            dtype=torch.float64,
        ).reshape(B, 3)
        for b, r in enumerate(rows):
            if r is None:
                continue
            if r.vocab_size != vocab_size:
                raise ValueError(f"row {b} was counted over {r.vocab_size} tokens, the logits have {vocab_size}")
            if r.bias is not None:
                bias[b] = torch.from_numpy(r.bias)
            seen[b] = torch.from_numpy(r.seen)
            generated[b] = torch.from_numpy(r.generated)
        return cls(bias, scalars[:, 0:1], scalars[:, 1:2], scalars[:, 2:3], seen, generated)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ProcessingRows:
        return ProcessingRows(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.bias, self.repetition, self.frequency, self.presence, self.seen, self.generated)
            )
        )

    def after(self, extra: Tensor) -> ProcessingRows:
        """The rows after further generated tokens, counted per row in `extra` [B, V] (float64)."""
        generated = self.generated + extra
        return ProcessingRows(
            self.bias, self.repetition, self.frequency, self.presence, self.seen | (extra > 0), generated
        )

    def apply(self, logits: Tensor) -> Tensor:
        """logits [B, V] -> float64 processed logits [B, V], LogitsProcessing.apply_np's ops in its order."""
        x = logits.double() + self.bias
        r = self.repetition
        x = (x / r).where(x > 0, x * r).where(self.seen, x)
        x = x - self.frequency * self.generated
        return x - self.presence * (self.generated > 0).double()
