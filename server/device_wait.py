"""Waiting for the GPU with the host thread asleep, not spinning.

CUDA synchronises by spinning by default (cudaDeviceScheduleAuto spins while the process has fewer contexts than
cores): a thread that reads a step's verdicts back with `.cpu()` or `stream.synchronize()` burns a host core for the
whole of the step. On a server that was the batcher's thread for most of each step: counted in the engine's CPU per
round (bench/server.py), and taken from the event loop, the front ends and the clients sharing the host. An event
made with blocking=True (cudaEventBlockingSync) puts the waiting thread to sleep until the device reaches it, at the
cost of the wake-up (tens of microseconds), once per step. torch releases the GIL during the wait either way.

Contract: `host_copy(t)` is `t.cpu()` (a CPU tensor is returned as it is): the copy lands in pinned memory and the
thread sleeps until it has. `copies(tensors)` enqueues copies of each tensor into pinned memory on the current stream
and returns them; `sleep_until_done()` sleeps until everything enqueued on the current stream so far has run. On the
CPU every one of them is a no-op or a plain copy.

    verdicts = host_copy(step.greedy)
"""

from __future__ import annotations

import torch
from torch import Tensor


def sleep_until_done() -> None:
    """Everything enqueued on the current CUDA stream has run (no-op without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()


def copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each tensor's copy in host memory, enqueued on the current stream (pinned: a CUDA tensor's copy does not wait
    for the device; `sleep_until_done` does)."""
    staged = {}
    for k, t in tensors.items():
        staged[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        staged[k].copy_(t, non_blocking=t.is_cuda)
    return staged


def host_copy(t: Tensor) -> Tensor:
    """`t.cpu()`, with the thread asleep while the device gets there."""
    if not t.is_cuda:
        return t
    out = copies({"t": t})["t"]
    sleep_until_done()
    return out
