"""What the server's refusals mean to the client: the typed reason and retry advice, from a call's status or
an inline Session-stream error.

Contract: `Refusal.of_rpc_error(e)` reads a failed call (its google.rpc.Status details, where the server packs a
tether.v1.ErrorDetail); `Refusal.of_inline(error)` reads a Session stream's `Error` message. Either gives the
status code, the `ErrorReason` (REASON_UNSPECIFIED when the server or a proxy in between sent none) and the
retry advice in seconds. The client branches on `.reason` and `.code`, never on the message, which is for people.
Nothing here trusts the details: unparsable or foreign details read as no reason, and retry advice is clamped
to [0, MAX_RETRY_S].

    try:
        stub.Resync(req)
    except grpc.RpcError as e:
        if Refusal.of_rpc_error(e).reason == pb.REASON_HISTORY_REQUIRED: ...
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import status_pb2

from tether.v1 import tether_pb2 as pb

MAX_RETRY_S = 60.0  # the longest retry advice the client follows (a server cannot park it for longer)
RETRYABLE = {pb.REASON_CAPACITY, pb.REASON_KEY_QUOTA}  # the server is full now: back off, draft alone, retry
LOST = {pb.REASON_UNKNOWN_SESSION, pb.REASON_SESSION_EVICTED}  # resync with the full history
_DETAILS_KEY = "grpc-status-details-bin"
_MAX_DETAILS_BYTES = 64 << 10


def _code(value: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)


def _known(reason: int) -> int:
    return reason if reason in pb.ErrorReason.values() else pb.REASON_UNSPECIFIED


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    reason: int  # a tether.v1.ErrorReason value
    message: str
    retry_after_s: float = 0.0

    @property
    def reason_name(self) -> str:
        return pb.ErrorReason.Name(self.reason).removeprefix("REASON_")

    @property
    def retryable(self) -> bool:
        return self.reason in RETRYABLE

    @classmethod
    def of_inline(cls, error: pb.Error) -> Refusal:
        return cls(_code(error.code), _known(error.reason), error.message, _clamp(error.retry_after_ms))

    @classmethod
    def of_rpc_error(cls, e: grpc.RpcError) -> Refusal:
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        message = (e.details() if callable(getattr(e, "details", None)) else "") or str(code.name)
        detail = _detail(e)
        if detail is None:
            return cls(code, pb.REASON_UNSPECIFIED, message)
        return cls(code, _known(detail.reason), message, _clamp(detail.retry_after_ms))


def _clamp(ms: int) -> float:
    return min(max(ms, 0) / 1000, MAX_RETRY_S)


def _detail(e: grpc.RpcError) -> pb.ErrorDetail | None:
    """The ErrorDetail in the call's status details, if the server sent one."""
    trailing = e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else None
    raw = next((v for k, v in trailing or () if k == _DETAILS_KEY), None)
    if not isinstance(raw, bytes) or len(raw) > _MAX_DETAILS_BYTES:
        return None
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
        for packed in status.details:
            if packed.Is(pb.ErrorDetail.DESCRIPTOR):
                detail = pb.ErrorDetail()
                packed.Unpack(detail)
                return detail
    except Exception:  # malformed details are no advice, never a crash: protobuf raises its own DecodeError
        return None
    return None
