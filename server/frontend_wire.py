"""Frames between the front-end processes and the engine process (`tether-server serve --frontends N`).

The front ends terminate gRPC (HTTP/2, TLS, authentication, call limits) and pass each tether.v1.Tether call to
the engine, which owns the models, the sessions and the batcher, over one Unix socket per front end. A call's
request and reply messages cross as the protobuf bytes the client sent and the engine made, with one exception: a
round's verdict crosses with its KV delta's bfloat16 bits unencoded (VERDICT), and the front end encodes the delta
and builds the reply, the very bytes the engine would have sent (`verdict_message`). Encoding a delta (byte planes
and zstd) was most of a reply's cost, on the engine's batcher thread, whose serial work with the event loop's holds
one GIL for every round the engine verifies. The engine never touches HTTP/2 (docs/ARCHITECTURE.md, section 6).

A frame is a 9-byte header, `call` (u32), `kind` (u8), `size` (u32), then `size` bytes. Call 0 is the link itself:

| kind | way | payload |
|---|---|---|
| CONFIG | engine -> front end, call 0 | JSON: the address to bind, TLS files, limits, API keys |
| HELLO | front end -> engine, call 0 | JSON: the front end's pid and the port it bound |
| STOP | engine -> front end, call 0 | JSON: `grace` seconds for the calls in flight (null: none) |
| CALL | front end -> engine | JSON: the method's name, the caller's identity and its host (tether.server.auth) |
| REQUEST | front end -> engine | one request message |
| HALF_CLOSE | front end -> engine | empty: the client sent its last request |
| CANCEL | front end -> engine | empty: the client went away; the engine cancels the handler |
| REPLY | engine -> front end | one reply message |
| VERDICT | engine -> front end | one round's reply, its delta's bits unencoded (`verdict_frame`): a reply message |
| END | engine -> front end | empty: the handler finished, status OK |
| ABORT | engine -> front end | JSON: status code, details, trailing metadata (binary values in base64) |
| CREDIT | both ways | u32: that many more messages of the call may be sent |
| DELTA_BYTES | front end -> engine, call 0 | u64: bytes of KV deltas it encoded since the last (the engine's metric) |

Flow control: a side sends at most `WINDOW` messages of a call ahead of the other side's CREDIT, which is given back
in halves as messages are consumed (a reply sent on to the client, a request read by the handler). So a fast
FetchWeights or a client that streams rounds ahead holds at most `WINDOW` messages in memory on the other side,
as gRPC's own flow control would have bounded them.

Writes are coalesced: `Outbox.send` queues a frame and the queue goes out in one write at the end of the event
loop's iteration, so a step's verdicts for many streams cost the engine one system call per front end.

    outbox = Outbox(transport, loop); outbox.send(7, Kind.REPLY, payload)
    for call, kind, payload in framer.feed(data): ...
    frame = verdict_frame(3, verdict.accepted, verdict.bonus, (), delta, Codec.FP16_SHUFFLE_ZSTD)  # engine
    frames = verdict_frames([(3, 0, 7, (), step.deltas[0], codec), ...])  # engine: a step's rows together
    message, delta_bytes = verdict_message(frame.payload)  # front end: the ServerMessage's bytes
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import enum
import json
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tether.server.step_deltas import RowDelta
from tether.shared import wire
from tether.shared.drafter_config import ArrayDelta
from tether.shared.wire import Codec, CodecError
from tether.v1 import tether_pb2 as pb

METHODS = {m.name: m for m in pb.DESCRIPTOR.services_by_name["Tether"].methods}  # what a CALL may name
HEADER = struct.Struct("<IBI")  # call, kind, size
CREDIT = struct.Struct("<I")
COUNT = struct.Struct("<Q")
VERDICT_HEAD = struct.Struct("<IIIIBHH")  # round, accepted, bonus, delta start, codec, delta tokens, path nodes
WINDOW = 16  # messages of one call in flight ahead of the other side's credit
MAX_FRAME = 64 << 20  # a frame larger than this is a broken peer (messages are bounded by max_message_bytes)


class Kind(enum.IntEnum):
    CONFIG = 1
    HELLO = 2
    STOP = 3
    CALL = 4
    REQUEST = 5
    HALF_CLOSE = 6
    CANCEL = 7
    REPLY = 8
    END = 9
    ABORT = 10
    CREDIT = 11
    VERDICT = 12
    DELTA_BYTES = 13


# Set by the engine inside a call a front end carries: a round's reply may then be a VerdictFrame (grpc.aio's own
# calls, served by the same service at the same time, get ServerMessages).
VERDICT_FRAMES: contextvars.ContextVar[bool] = contextvars.ContextVar("tether_verdict_frames", default=False)


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol: the link is dropped."""


_KINDS = {int(k): k for k in Kind}


class Framer:
    """Splits a byte stream into frames."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self.buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> Iterator[tuple[int, Kind, bytes]]:
        self.buf += data
        pos, buf = 0, self.buf
        try:
            while len(buf) - pos >= HEADER.size:
                call, kind, size = HEADER.unpack_from(buf, pos)
                if size > self.max_frame:
                    raise FrameError(f"a frame of {size} bytes is over the {self.max_frame}-byte limit")
                end = pos + HEADER.size + size
                if end > len(buf):
                    break
                k = _KINDS.get(kind)  # Kind(kind) costs ten times this lookup, on every frame
                if k is None:
                    raise FrameError(f"unknown frame kind {kind}")
                yield call, k, bytes(buf[pos + HEADER.size : end])
                pos = end
        finally:
            del buf[:pos]


class Outbox:
    """Frames for one transport, written together once per event-loop iteration."""

    def __init__(self, transport: asyncio.WriteTransport, loop: asyncio.AbstractEventLoop):
        self.transport, self.loop = transport, loop
        self.pending: list[bytes] = []

    def send(self, call: int, kind: Kind, payload: bytes = b"") -> None:
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending += (HEADER.pack(call, kind, len(payload)), payload)

    def _flush(self) -> None:
        data, self.pending = b"".join(self.pending), []
        if not self.transport.is_closing():
            self.transport.write(data)


def credit(n: int) -> bytes:
    return CREDIT.pack(n)


def read_credit(payload: bytes) -> int:
    if len(payload) != CREDIT.size:
        raise FrameError("a CREDIT frame carries 4 bytes")
    return CREDIT.unpack(payload)[0]


def count(n: int) -> bytes:
    return COUNT.pack(n)


def read_count(payload: bytes) -> int:
    if len(payload) != COUNT.size:
        raise FrameError("a DELTA_BYTES frame carries 8 bytes")
    return COUNT.unpack(payload)[0]


@dataclass(frozen=True)
class VerdictFrame:
    """A round's reply as the engine hands it to a front end (a VERDICT frame's payload)."""

    payload: bytes


# A VERDICT's delta: a layout (each tensor's name and shape), then the tensors' bfloat16 bits in C order, one after
# another. Engine and front ends share one host and one build, so the bits cross in native order and the layout is
# this module's alone; the front end builds the wire's bundle from them (tether.shared.wire, any codec).
_LAYOUT_COUNT = struct.Struct("<B")  # tensors
_LAYOUT_ENTRY = struct.Struct("<BB")  # name length, ndim; then the name and ndim u32 dims
_LAYOUTS: dict[tuple, bytes] = {}  # ((name, shape, dtype), ...) -> the layout's bytes: a step's rows share a few
_MAX_LAYOUTS = 4096
_MAX_TENSORS = 64


def _layout(tensors: dict) -> bytes:
    key = tuple((name, a.shape, a.dtype) for name, a in tensors.items())
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(key) > _MAX_TENSORS or any(dtype != np.uint16 for *_, dtype in key):
            raise struct.error(f"a VERDICT frame carries at most {_MAX_TENSORS} tensors of bfloat16 bits")
        parts = [_LAYOUT_COUNT.pack(len(key))]
        for name, shape, _ in key:
            raw = name.encode()
            parts += [_LAYOUT_ENTRY.pack(len(raw), len(shape)), raw, struct.pack(f"<{len(shape)}I", *shape)]
        layout = b"".join(parts)
        if len(_LAYOUTS) < _MAX_LAYOUTS:
            _LAYOUTS[key] = layout
    return layout


_IDS: dict[int, struct.Struct] = {}  # a VERDICT's ids by count: a Struct per count, not a format string per round


def _ids_struct(n: int) -> struct.Struct:
    ids = _IDS.get(n)
    if ids is None:
        ids = _IDS.setdefault(n, struct.Struct(f"<{n}I"))
    return ids


def verdict_frame(
    round_no: int, accepted: int, bonus: int, path: Sequence[int], delta: ArrayDelta, codec: Codec
) -> VerdictFrame:
    """The verdict of round `round_no` with its delta's bfloat16 bits unencoded (uint16 arrays, any strides): a
    head, the ids, a layout and the bits, a few microseconds a round on the batcher's thread where building the
    wire's bundle took three times that. `path`: a tree round's accepted nodes, the root left out (a chain round:
    empty). Raises struct.error for what no reply could carry."""
    head = VERDICT_HEAD.pack(round_no, accepted, bonus, delta.start, int(codec), len(delta.tokens), len(path))
    ids = _ids_struct(len(delta.tokens) + len(path)).pack(*delta.tokens, *path)
    tensors = delta.tensors
    return VerdictFrame(b"".join((head, ids, _layout(tensors), *(a.tobytes() for a in tensors.values()))))


def verdict_frames(rows: Sequence[tuple[int, int, int, Sequence[int], ArrayDelta, Codec]]) -> list[VerdictFrame]:
    """`verdict_frame(*row)` for each of a step's rows, the same bytes, made together: the bits of rows whose deltas
    are RowDeltas of one StepDeltas (the batcher's) come from one copy of each tensor for the step, a layout is
    made once for each row size, and a row costs a head, its ids and one join. Raises struct.error as
    verdict_frame does (for any row: the caller frames the rows one by one to find it)."""
    frames: list = [None] * len(rows)
    steps: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        delta = row[4]
        if type(delta) is RowDelta:
            steps.setdefault(id(delta.step), []).append(i)
        else:
            frames[i] = verdict_frame(*row)
    for members in steps.values():
        step = rows[members[0]][4].step
        bits = [step.row_bits(name) for name in step.picked]
        layouts: dict[int, bytes] = {}
        pack_head = VERDICT_HEAD.pack
        for i in members:
            round_no, accepted, bonus, path, delta, codec = rows[i]
            tokens, r = delta.tokens, delta.row
            n = len(tokens)
            layout = layouts.get(n)
            if layout is None:
                layout = layouts[n] = _layout(delta.tensors)
            ids = _IDS.get(n + len(path)) or _ids_struct(n + len(path))
            parts = [pack_head(round_no, accepted, bonus, delta.start, codec, n, len(path)), ids.pack(*tokens, *path)]
            parts.append(layout)
            for b, e in bits:
                parts.append(b[e[r] : e[r + 1]])
            frames[i] = VerdictFrame(b"".join(parts))
    return frames


def _read_layout(payload: memoryview, pos: int, max_nbytes: int) -> dict[str, np.ndarray]:
    """The delta of a VERDICT frame from `pos` on: {name: uint16 array}, views of `payload`. Every size is checked
    against the bytes there before anything is allocated."""
    (n,) = _LAYOUT_COUNT.unpack_from(payload, pos)
    pos += _LAYOUT_COUNT.size
    if not 0 < n <= _MAX_TENSORS:
        raise CodecError(f"{n} tensors")
    shapes = {}
    for _ in range(n):
        n_name, ndim = _LAYOUT_ENTRY.unpack_from(payload, pos)
        pos += _LAYOUT_ENTRY.size
        if not 0 < n_name <= wire.MAX_NAME_BYTES or not 0 < ndim <= wire.MAX_NDIM:
            raise CodecError(f"a name of {n_name} bytes or {ndim} dims")
        name = bytes(payload[pos : pos + n_name]).decode()
        pos += n_name
        shapes[name] = struct.unpack_from(f"<{ndim}I", payload, pos)
        pos += 4 * ndim
    if len(shapes) != n:
        raise CodecError("a tensor named twice")
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    total = 2 * sum(sizes.values())
    if total > max_nbytes:
        raise CodecError(f"a delta of {total} bytes is over the {max_nbytes}-byte bound")
    if total != len(payload) - pos:
        raise CodecError(f"the layout declares {total} bytes of bits, the frame has {len(payload) - pos}")
    arrays = {}
    for name, shape in shapes.items():
        arrays[name] = np.frombuffer(payload, np.uint16, sizes[name], pos).reshape(shape)
        pos += 2 * sizes[name]
    return arrays


def verdict_message(payload: bytes, *, max_nbytes: int = wire.DEFAULT_MAX_NBYTES) -> tuple[bytes, int]:
    """A VERDICT frame's reply: the ServerMessage bytes the engine would have made in process (the same encoder on
    the same bits), and the size of its encoded delta. `max_nbytes` bounds the delta. Raises FrameError for a frame
    that is not one."""
    try:
        round_no, accepted, bonus, start, codec, n_tokens, n_path = VERDICT_HEAD.unpack_from(payload)
        codec = Codec(codec)
        ids = struct.unpack_from(f"<{n_tokens + n_path}I", payload, VERDICT_HEAD.size)
        arrays = _read_layout(memoryview(payload), VERDICT_HEAD.size + 4 * (n_tokens + n_path), max_nbytes)
        delta = wire.encode_bf16_bundle(arrays, codec)
    except (struct.error, ValueError, CodecError) as e:
        raise FrameError(f"a VERDICT frame that does not parse: {e}") from None
    kv = pb.KVDelta(start=start, tokens=ids[:n_tokens], payload=delta)
    verdict = pb.Verdict(round=round_no, accepted=accepted, bonus=bonus, delta=kv, path=ids[n_tokens:])
    return pb.ServerMessage(verdict=verdict).SerializeToString(), len(delta)


def dump(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def load(payload: bytes) -> dict:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"a frame's JSON does not parse: {e}") from None
    if not isinstance(obj, dict):
        raise FrameError("a frame's JSON is not an object")
    return obj


def dump_metadata(metadata) -> list[list]:
    """gRPC trailing metadata as JSON: binary values (keys ending in -bin) in base64."""
    return [[k, base64.b64encode(v).decode() if isinstance(v, bytes) else v] for k, v in metadata or ()]


def load_metadata(rows: list) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, base64.b64decode(v) if k.endswith("-bin") else v) for k, v in rows)


class Credit:
    """How many more messages of a call this side may send, and a wait for more."""

    def __init__(self, n: int = WINDOW):
        self.n = n
        self.more = asyncio.Event()

    def add(self, n: int) -> None:
        self.n += n
        self.more.set()

    async def take(self) -> None:
        while self.n <= 0:
            self.more.clear()
            await self.more.wait()
        self.n -= 1


class Consumed:
    """Counts messages consumed on the receiving side and says when a half window of credit goes back."""

    def __init__(self):
        self.count = 0

    def one(self) -> int:
        self.count += 1
        if self.count >= WINDOW // 2:
            n, self.count = self.count, 0
            return n
        return 0
