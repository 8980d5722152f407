"""The sampling controls on the edge client's paths: what every call to the server carries of them, what a server
that does not apply them is told, and which tokens end a generation.

Contract:
- `ClientConfig.controls()` (tether.client.session_types) holds a generation's sampling rule as
  tether.shared.logits_processing.SamplingControls, checked on construction (ControlError, a ValueError naming the
  control: `tether-client` exits 2 with its one line). The drafter proposes from that same rule
  (tether.client.rounds and resync: each drafted position with the counts of its own context), so greedy drafts under
  penalties are the processed rule's greedy tokens and the text drafted offline is the drafter's processed greedy
  text.
- `sampling_params(cfg, info, logprobs=None)` -> pb.SamplingParams: what open, Resync and Generate send:
  temperature, top_p, top_k, seed, ignore_eos (Generate's: the server streams to max_new_tokens; a session's end
  is the client's, by `stop_ids`), `logprobs` when given (report each verified token's and this many top ones'),
  and the logits controls and stop token ids only to a server that says it applies them
  (ModelInfo.sampling_controls; older servers ignore the fields, so they are never sent one).
- `check_controls(cfg, info, vocab_size)`: before anything is downloaded, ControlsNotOffered (a ServerError:
  FAILED_PRECONDITION, `tether-client` exits 1) when a control is set and the server does not apply them, rather
  than dropping them in silence; ControlError when a logit_bias or stop token id is outside the vocabulary.
- `stop_ids(cfg, info, tokenizer)` -> frozenset: the ids that end a generation on every client path: the model's
  end-of-text ids (ModelInfo.eos_id and eos_ids, else the tokenizer's own: tether.client.pairing_checks, which
  gives the tokenizer the same ones; checked, and left out under `cfg.ignore_eos`) and the request's stop token
  ids.
Importing this module imports no torch and no onnxruntime.

    check_controls(cfg, info, model_cfg.vocab_size)
    open_ = pb.OpenSession(prompt=prompt, sampling=sampling_params(cfg, info), ...)
"""

from __future__ import annotations

import grpc

from tether.client.errors import Problem, ServerDataError
from tether.client.pairing_checks import served_eos_ids
from tether.client.session_types import ClientConfig
from tether.client.transport import ServerError
from tether.shared.logits_processing import ControlError
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb


class ControlsNotOffered(ServerError):
    """A sampling control was asked of a server that does not apply them (ModelInfo.sampling_controls false)."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


def controls_set(cfg: ClientConfig) -> list[str]:
    """The names of the controls an older server would ignore that `cfg` sets (min_p, penalties, logit_bias,
    stop token ids)."""
    c = cfg.controls()
    named = {
        "min_p": c.min_p != 0,
        "presence_penalty": c.presence_penalty != 0,
        "frequency_penalty": c.frequency_penalty != 0,
        "repetition_penalty": c.repetition_penalty != 1,
        "logit_bias": bool(c.logit_bias),
        "stop_token_ids": bool(cfg.stop_token_ids),
    }
    return [name for name, on in named.items() if on]


def check_controls(cfg: ClientConfig, info: pb.ModelInfo, vocab_size: int) -> None:
    """See the module docstring."""
    asked = controls_set(cfg)
    if asked and not info.sampling_controls:
        raise ControlsNotOffered(
            f"the server does not apply {', '.join(asked)} (a server older than this client): "
            "leave them out, or upgrade the server"
        )
    cfg.controls().check_vocab(vocab_size)
    outside = [t for t in cfg.stop_token_ids if t >= vocab_size]
    if outside:
        raise ControlError("stop_token_ids", f"stop token {outside[0]} is outside the vocabulary of {vocab_size}")


def sampling_params(cfg: ClientConfig, info: pb.ModelInfo, logprobs: int | None = None) -> pb.SamplingParams:
    """See the module docstring."""
    params = pb.SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, top_k=cfg.top_k, ignore_eos=cfg.ignore_eos
    )
    if logprobs is not None:
        params.logprobs = logprobs
    if not info.sampling_controls:
        return params
    c = cfg.controls()
    params.min_p, params.presence_penalty, params.frequency_penalty = c.min_p, c.presence_penalty, c.frequency_penalty
    if c.repetition_penalty != 1:
        params.repetition_penalty = c.repetition_penalty
    params.logit_bias.update(dict(c.logit_bias))
    params.stop_token_ids.extend(cfg.stop_token_ids)
    return params


def stop_ids(cfg: ClientConfig, info: pb.ModelInfo, tokenizer: Tokenizer) -> frozenset[int]:
    """See the module docstring."""
    ends = served_eos_ids(info) or tokenizer.eos_ids
    outside = [t for t in ends if not 0 <= t < tokenizer.vocab_size]
    if outside:
        raise ServerDataError(Problem.MODEL_INFO, f"end-of-text id {outside[0]} is outside the vocabulary")
    return (frozenset() if cfg.ignore_eos else frozenset(ends)) | frozenset(cfg.stop_token_ids)
