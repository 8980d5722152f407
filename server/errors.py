"""Typed refusals: every error the server answers carries a gRPC status code and an `ErrorReason` for programs.

Contract:
- `RequestError(reason, message, retry_after_s=0.0)` is what handlers raise for anything a caller did or must do;
  the status code follows from the reason (`CODES`), so the two never disagree. Clients branch on the reason
  (tether.v1.ErrorReason), never on the message, which is for people.
- `status_metadata(error)` is the trailing metadata of a call that ends with that error: a google.rpc.Status
  whose details hold a tether.v1.ErrorDetail (reason, retry-after) and, when there is retry advice, the standard
  google.rpc.RetryInfo, so generic gRPC tooling shows it too (`grpc-status-details-bin`).
- `inline(error, round)` is the same refusal as an inline `Error` message on the Session stream, which stays open.

    raise RequestError(Reason.CAPACITY, "all 8 sessions are busy", retry_after_s=0.5)
"""

from __future__ import annotations

import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from tether.v1 import tether_pb2 as pb

Reason = pb.ErrorReason  # the enum's values: Reason.REASON_CAPACITY, ...

CODES: dict[int, grpc.StatusCode] = {
    pb.REASON_UNSPECIFIED: grpc.StatusCode.UNKNOWN,
    pb.REASON_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.REASON_KEY_QUOTA: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.REASON_HISTORY_REQUIRED: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REASON_SESSION_EVICTED: grpc.StatusCode.NOT_FOUND,
    pb.REASON_REPLY_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.REASON_UNKNOWN_SESSION: grpc.StatusCode.NOT_FOUND,
    pb.REASON_INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    pb.REASON_UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    pb.REASON_WRONG_RESUME_TOKEN: grpc.StatusCode.PERMISSION_DENIED,
    pb.REASON_MODEL_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REASON_OUT_OF_ORDER: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REASON_TOO_LONG: grpc.StatusCode.RESOURCE_EXHAUSTED,
    pb.REASON_STREAM_IDLE: grpc.StatusCode.DEADLINE_EXCEEDED,
    pb.REASON_INTERNAL: grpc.StatusCode.INTERNAL,
    pb.REASON_SESSION_FULL: grpc.StatusCode.OUT_OF_RANGE,
    pb.REASON_NO_DRAFTER: grpc.StatusCode.FAILED_PRECONDITION,
    pb.REASON_STALE_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
}
assert set(CODES) == set(Reason.values()), "every ErrorReason needs its status code"


class RequestError(Exception):
    """A refusal: the reason (and so the status code), a message for people, and when to try again; `field`, the
    request field at fault where one is (a sampling control: the HTTP API's `param`, gRPC's BadRequest detail)."""

    def __init__(self, reason: int, message: str, retry_after_s: float = 0.0, *, field: str | None = None):
        super().__init__(message)
        self.reason, self.message, self.retry_after_s, self.field = reason, message, retry_after_s, field

    @property
    def code(self) -> grpc.StatusCode:
        return CODES[self.reason]

    @property
    def reason_name(self) -> str:
        return Reason.Name(self.reason).removeprefix("REASON_")

    @property
    def retry_after_ms(self) -> int:
        return math.ceil(self.retry_after_s * 1000) if self.retry_after_s > 0 else 0

    def detail(self) -> pb.ErrorDetail:
        return pb.ErrorDetail(reason=self.reason, retry_after_ms=self.retry_after_ms)


def status_metadata(error: RequestError) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying the rich status of `error` (what grpc_status.rpc_status.from_call reads)."""
    details = [_pack(error.detail())]
    if error.retry_after_ms:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    if error.field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    status = status_pb2.Status(code=error.code.value[0], message=error.message, details=details)
    return (("grpc-status-details-bin", status.SerializeToString()),)


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def inline(error: RequestError, round_no: int = 0) -> pb.ServerMessage:
    """The refusal as an inline Session-stream message (the stream stays open)."""
    return pb.ServerMessage(
        error=pb.Error(
            code=error.code.value[0],
            message=error.message,
            round=round_no,
            reason=error.reason,
            retry_after_ms=error.retry_after_ms,
        )
    )
