"""Every implementation of a role has every member of its Protocol (tether.shared.contracts), with a signature that
accepts the Protocol's parameters: a member added to a Protocol and missing from an implementation fails here.

Caches, targets and draft backends are checked as instances (their data members are set in __init__), drafters as
classes where they have no data members (the ONNX drafter, the loop, the edge's gate)."""

import inspect
import typing

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.delta_gate import DeltaGate
from tether.client.onnx_backends import OnnxEagleBackend, OnnxMoABackend
from tether.client.onnx_drafter import OnnxDrafter
from tether.server.kv_pool import KVPool, PagedKernelView, SlotView
from tether.server.onnx_export import export_client_onnx
from tether.server.rounds import BatchCacheView, PagedBatchView
from tether.server.tp import GatherKV
from tether.server.tp_serve import TPTarget
from tether.shared import contracts
from tether.shared.draft_loop import DraftLoop
from tether.shared.drafter import DrafterConfig
from tether.shared.drafter_loading import build_drafter
from tether.shared.drafter_runtime import TorchDraftBackend

# Members an implementation still lacks, each waiting on a file being changed elsewhere: a gap not listed here
# fails, and so does a listed one that has been closed. None now.
PENDING: dict[type, set[str]] = {}


def members(proto: type) -> dict[str, object]:
    """The Protocol's members, its bases' included: name -> the function or property (None for a data member)."""
    out: dict[str, object] = {}
    for base in reversed(proto.__mro__):
        if base is typing.Protocol or not getattr(base, "_is_protocol", False):
            continue
        out.update({name: None for name in base.__dict__.get("__annotations__", {})})
        public = {n: v for n, v in vars(base).items() if not n.startswith("_")}
        out.update({n: v for n, v in public.items() if callable(v) or isinstance(v, property)})
    return out


def signature_problem(want, got) -> str | None:
    """None when `got` accepts every parameter of `want` as `want` passes it and requires nothing more (a
    positional-only parameter of the Protocol by its place, any other by its name)."""
    w, g = inspect.signature(want), inspect.signature(got)
    wp = [p for p in w.parameters.values() if p.name != "self"]
    gl = [p for p in g.parameters.values() if p.name != "self"]
    gp = {p.name: p for p in gl}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in gl)
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in gl)
    named = set()
    for i, p in enumerate(wp):
        if p.kind is p.POSITIONAL_ONLY:
            if not (i < len(gl) and gl[i].kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)) and not var_pos:
                return f"takes no positional parameter {i} ({p.name})"
            named.add(gl[i].name if i < len(gl) else p.name)
        elif p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            if not any(q.kind is p.kind for q in gp.values()):
                return f"takes no {p}"
        elif p.name not in gp and not (var_kw or (var_pos and p.kind is p.POSITIONAL_OR_KEYWORD)):
            return f"has no parameter {p.name!r}"
    named |= {p.name for p in wp}
    extra = [q.name for q in gp.values() if q.name not in named and q.default is q.empty
             and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)]  # fmt: skip
    return f"requires {extra}, which the Protocol does not pass" if extra else None


def gaps(proto: type, impl: object) -> set[str]:
    """The Protocol's members `impl` (an instance or a class) lacks or takes differently, as 'name: why'."""
    cls = impl if isinstance(impl, type) else type(impl)
    out = set()
    for name, member in members(proto).items():
        if not hasattr(impl, name):
            out.add(name)
            continue
        if callable(member) and not isinstance(member, property):
            problem = signature_problem(member, getattr(impl, name) if isinstance(impl, type) else getattr(cls, name))
            if problem:
                out.add(f"{name}: {problem}")
    return out


def check(proto: type, impl: object) -> None:
    cls = impl if isinstance(impl, type) else type(impl)
    missing = gaps(proto, impl)
    pending = PENDING.get(cls, set())
    assert missing - pending == set(), f"{cls.__name__} does not satisfy {proto.__name__}: {sorted(missing)}"
    closed = {name for name in pending if name in members(proto) and name not in missing}
    assert not closed, f"{cls.__name__} now has {sorted(closed)}: drop it from PENDING (and the probe it kept)"


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _caches(target):
    pool = KVPool(target.cfg, 8, 4)
    seq = pool.sequence(16)
    slots = torch.arange(2)
    view = SlotView(pool, slots, slots, torch.zeros(1, 0, dtype=torch.long))
    kernel = PagedKernelView(pool, slots, None, torch.zeros(1, 1), torch.tensor([2]), torch.tensor([2]))
    return {
        "KVCache": target.new_cache(1, 16),
        "PagedCache": seq,
        "SlotView": view,
        "PagedKernelView": kernel,
        "BatchCacheView": BatchCacheView([target.new_cache(1, 16)], [1]),
        "PagedBatchView": PagedBatchView([pool.sequence(16)], [1]),
    }


@pytest.mark.parametrize("name", ["KVCache", "PagedCache", "SlotView", "PagedKernelView", "BatchCacheView",
                                  "PagedBatchView"])  # fmt: skip
def test_every_cache_is_a_forward_cache(target, name):
    check(contracts.ForwardCache, _caches(target)[name])


@pytest.mark.parametrize("name", ["KVCache", "PagedCache"])
def test_sequence_caches(target, name):
    check(contracts.SequenceCache, _caches(target)[name])


def test_kv_cache_attends_through_the_backend(target):
    """A contiguous cache has no in-place path: its `attend` answers None and the model writes and gathers."""
    cache = target.new_cache(1, 8)
    q = torch.zeros(1, 1, target.cfg.n_heads, target.cfg.head_dim)
    k = torch.zeros(1, 1, target.cfg.n_kv_heads, target.cfg.head_dim)
    assert cache.attend(0, q, k, k, None, None, scale=1.0, tree_mask=None) is None
    cache.reserve(8)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.reserve(9)
    cache.release()  # nothing to give back


def test_paged_caches_attend_through_the_backend_and_the_kernel_view_refuses_write(target):
    """A pool sequence and the gathering views answer `attend` with None (the model writes and gathers); the kernel
    view reads the pool in place and has no keys to give back, so its `write` refuses."""
    caches = _caches(target)
    q = torch.zeros(1, 1, target.cfg.n_heads, target.cfg.head_dim)
    k = torch.zeros(1, 1, target.cfg.n_kv_heads, target.cfg.head_dim)
    for name in ("PagedCache", "SlotView", "BatchCacheView", "PagedBatchView"):
        assert caches[name].attend(0, q, k, k, None, None, scale=1.0, tree_mask=None) is None, name
    with pytest.raises(TypeError, match="attends in place"):
        caches["PagedKernelView"].write(0, k, k)


def test_targets(target):
    check(contracts.Target, target)
    check(contracts.Target, TPTarget(target, None))  # rank 0's handle, without a process group: no call made
    assert TPTarget(target, None).dtype == target.dtype == target.embed_tokens.weight.dtype


def _torch_drafter(target, kind: str):
    if kind == "moa":
        return tiny_moa_drafter(target)
    return build_drafter(target, DrafterConfig(kind="eagle", n_heads=4, n_kv_heads=2, head_dim=12))


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_torch_drafters(target, kind):
    drafter = _torch_drafter(target, kind)
    check(contracts.SpeculativeDrafter, drafter)
    check(contracts.ServerDrafter, GatherKV(drafter))
    assert drafter.depth_predictor is None  # the member drafter training reads, on either kind


@pytest.mark.parametrize("cls", [OnnxDrafter, DraftLoop, DeltaGate])
def test_client_drafters(cls):
    check(contracts.Drafter, cls)


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_draft_backends(target, kind, tmp_path):
    """The one drafting loop's backends: the torch drafters' and the ONNX graphs' of each kind."""
    drafter = _torch_drafter(target, kind)
    check(contracts.DraftBackend, TorchDraftBackend(drafter))
    export_client_onnx(drafter, tmp_path)
    onnx = OnnxDrafter.load(tmp_path)
    assert isinstance(onnx.backend, {"moa": OnnxMoABackend, "eagle": OnnxEagleBackend}[kind])
    check(contracts.DraftBackend, onnx.backend)


def test_a_missing_member_fails():
    """The check itself: a class without one of the Protocol's methods, or taking it differently, is caught."""

    class Half:
        length = 0

        def write(self, layer, k, v):
            return k, v

    class Wrong(Half):
        def attend(self, layer, q, k, v):  # no depth, no scale
            return None

    assert gaps(contracts.ForwardCache, Half()) == {"attend"}
    assert any(g.startswith("attend: has no parameter") for g in gaps(contracts.ForwardCache, Wrong()))
