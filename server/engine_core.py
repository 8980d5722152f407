"""The engine: one per GPU, built the same way by every entry point (serve, warm, engine processes, generate, the
benches, the tests), in the spirit of vLLM's EngineCore.

Contract:
- `Engine.build(cfg)` starts from a ServeConfig (tether.server.serve_config): points Triton at its kernel cache,
  loads the target and drafter (tether.server.model_loading), shards a tensor-parallel target over its ranks, sizes
  the KV pool from the memory left (tether.server.pool_budget: --kv-pool-mb 0 is a share of the free device memory,
  logged), and assembles the engine. `Engine(target, drafter, tokenizer, config,
  model_fingerprint=...)` assembles one from models already loaded (tests, benches).
- The engine alone owns the serving state: the models, the client part (tensors, manifest, ONNX exports), ModelInfo,
  the paged KV pool, the session table (which alone creates and retires sessions), the batcher, the model threads,
  the checks every request passes, plain decoding (`engine.plain`, tether.server.plain_decoding) and what Generate
  and the HTTP API decode with (`engine.decoding`: plain decoding, or with `server_draft` the drafter's rounds made
  on this server, tether.server.server_draft). Front ends (tether.server.service for gRPC, tether.server.http_api
  for HTTP) are handlers over it.
- `warm_up()` runs serve's kernel warm-up and step-graph captures (its cache state: "warm cache", "cold cache", "no
  kernel warm-up"); `settle()` takes start-up's heap out of the garbage collector's walks; `close()` ends its threads
  and, for a tensor-parallel target, its ranks (the process is stopping); `record_shapes()` keeps the step graphs it
  captured for the next start.

    engine = Engine.build(ServeConfig(model="deploy/models/target"))
    engine.warm_up(); engine.settle()
    service = TetherService(engine)                       # tether.server.service: the gRPC handlers
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import sys
import time
import weakref
from pathlib import Path

import torch

from tether.server import heap
from tether.server.batcher import RoundBatcher, warm_up
from tether.server.client_export import FORMATS, ClientExporter, ExportError
from tether.server.errors import Reason, RequestError
from tether.server.kv_pool import KVPool
from tether.server.metrics import ServiceMetrics
from tether.server.model_loading import load_models, pick_device
from tether.server.model_work import ModelWork
from tether.server.plain_decoding import PlainDecoder
from tether.server.pool_budget import resolve_kv_pool
from tether.server.serve_config import SERVER_DRAFT_NEEDS_DRAFTER, ServeConfig, ServiceConfig, service_config
from tether.server.server_draft import ServerDraftDecoder
from tether.server.sessions import Claim, Session, SessionTable, TableLimits
from tether.server.tp_serve import TPTarget, join_rank0, shard, start_followers
from tether.server.validation import Checks, check_id, invalid, requested_logprobs, sampling_controls
from tether.server.verifier import SequenceVerifier
from tether.server.warm_cache import (
    count_entries,
    current_dir,
    kernel_cache_dir,
    load_shapes,
    record_shapes,
    use_cache_dir,
)
from tether.shared import wire
from tether.shared.chat_template import ChatFormat
from tether.shared.codecs import Codec, encode_many
from tether.shared.contracts import Target
from tether.shared.drafter import DraftDelta
from tether.shared.drafter_config import ArrayDelta
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import (
    TOKENIZER_TENSOR,
    build_manifest,
    client_part_tensors,
    drafter_fingerprint,
    tokenizer_part,
    tokenizer_tensor,
)
from tether.v1 import tether_pb2 as pb

PROTOCOL_VERSION = 1
log = logging.getLogger("tether.server")


def use_cache(cfg: ServeConfig) -> Path:
    """Point Triton at --cache-dir (before anything compiles, and before --tp followers and engine processes start:
    they inherit TRITON_CACHE_DIR); the directory Triton's cache is in either way."""
    kernel_dir = use_cache_dir(cfg.cache_dir) if cfg.cache_dir else kernel_cache_dir()
    log.info("kernel cache %s: %d files", kernel_dir, count_entries(kernel_dir))
    return kernel_dir


class Engine:
    def __init__(
        self,
        target: Target,
        drafter,
        tokenizer: Tokenizer,
        config: ServiceConfig | None = None,
        *,
        model_fingerprint: str,
        client_weights: dict[str, torch.Tensor] | None = None,
        pool: KVPool | None = None,
        export_dir: str | os.PathLike | None = None,
        chat_format: ChatFormat | None = None,
        kernel_dir: Path | None = None,
        round_graph_tokens: int = 0,
        server_draft: int = 0,
    ):
        """`drafter` None serves without one (server-only decoding). `client_weights` and `pool` are for a
        tensor-parallel target (tether.server.tp_serve), whose own weights are sharded: the client part computed
        before sharding, and rank 0's mirrored pool shard. `export_dir` keeps the ONNX client part's exports across
        restarts (None: a temporary directory). `chat_format`: the model's chat template (None: the built-in one).
        `kernel_dir` and `round_graph_tokens` are what `warm_up` compiles into and captures for. `server_draft` > 0:
        Generate and the HTTP API draft that many tokens a round with `drafter` here (tether.server.server_draft)."""
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.chat_format = chat_format or ChatFormat.builtin_for(tokenizer)
        self.config = c = config or ServiceConfig()
        if c.gil_switch_s > 0 and target.device.type == "cuda":  # process-wide: this process runs the engine
            sys.setswitchinterval(c.gil_switch_s)
        self.model_fingerprint = model_fingerprint
        self.kernel_dir = kernel_dir if kernel_dir is not None else kernel_cache_dir()
        self.round_graph_tokens = round_graph_tokens
        self._stop_ranks = None  # a tensor-parallel target's: ends its ranks (Engine.build sets it)
        self._pauses: heap.GCPauses | None = None
        # The tokenizer alone, for clients that decode with Generate, drafter or not: named by the tokenizer's hash.
        self.tokenizer_files, self.tokenizer_manifest = tokenizer_part(tokenizer.to_json())
        if self.tokenizer_manifest[0].sha256 != tokenizer.sha256:  # both hash the same canonical JSON
            raise RuntimeError("the tokenizer part's sha256 is not the tokenizer's (shared/weights.py, tokenizer.py)")
        # Without a drafter (`serve --drafter none`) there is no client part: only Generate and the HTTP API decode.
        self.weights: dict[str, torch.Tensor] = {}
        self.manifest: list = []
        self.drafter_fingerprint = ""
        self.exporter: ClientExporter | None = None
        if drafter is not None:
            part = client_weights if client_weights is not None else client_part_tensors(target, drafter)
            self.weights = {
                k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in part.items()
            }
            # The tokenizer travels with the weights (resumable, cached by hash): a client needs only an address.
            self.weights[TOKENIZER_TENSOR] = tokenizer_tensor(tokenizer.to_json())
            self.manifest = build_manifest(self.weights)
            self.drafter_fingerprint = drafter_fingerprint(drafter.dcfg.to_dict(), self.manifest)
            self.exporter = ClientExporter(target.cfg, drafter.dcfg, self.weights, self.drafter_fingerprint, export_dir)
        drafting = [pb.CLIENT_PART_TENSORS, *FORMATS] if drafter is not None else []
        # Every id that ends a generation: the tokenizer's (config.json / generation_config.json lists, its own
        # end-of-text) and the chat format's generation_config ids, first one first.
        self.eos_ids = tuple(dict.fromkeys([*tokenizer.eos_ids, *self.chat_format.extra_stop_ids]))
        self.model_info = pb.ModelInfo(
            protocol_version=PROTOCOL_VERSION,
            model_id=c.model_id,
            model_config_json=json.dumps(target.cfg.to_dict()),
            model_fingerprint=model_fingerprint,
            tokenizer_sha256=tokenizer.sha256,
            drafter_config_json=json.dumps(drafter.dcfg.to_dict()) if drafter is not None else "",
            drafter_fingerprint=self.drafter_fingerprint,
            tli_layers=drafter.dcfg.tli if drafter is not None else 0,
            codecs=[int(c) for c in Codec],  # every codec it sends: the client's offer picks (validation.pick_codec)
            max_prompt_tokens=c.max_prompt_tokens,
            max_draft_tokens=c.max_draft_tokens,
            max_message_bytes=c.max_message_bytes,
            client_part_formats=[*drafting, pb.CLIENT_PART_TOKENIZER],  # the tokenizer alone from any server
            server_only=drafter is None,
            chat_format_json=self.chat_format.to_json(),
            max_tree_nodes=c.max_draft_tokens if drafter is not None else 0,  # a tree's nodes take a chain's room
            eos_id=self.eos_ids[0] if self.eos_ids else None,  # None leaves it unset
            overlapping_rounds=drafter is not None,
            eos_ids=self.eos_ids,
            clean_up_tokenization_spaces=tokenizer.clean_up_spaces,  # an edge decodes as the model folder asks
            sampling_controls=True,
        )  # what GetModelInfo answers: built once (the tokenizer's hash alone takes milliseconds)
        self.metrics = ServiceMetrics()
        self.pool = pool or KVPool.for_budget(
            target.cfg, c.kv_pool_bytes, c.kv_block_size, device=target.device, dtype=target.dtype
        )
        # The step runner of this engine's rounds, made here once (the pool owns it; a tensor-parallel pool makes its
        # broadcasting kind): on the "triton" backend, the one that runs fixed-shape steps.
        self.runner = self.pool.runner_for(target) if target.backend == "triton" else None
        limits = TableLimits(c.max_sessions, c.max_sessions_per_key, c.session_lease_s, c.engine)
        self.table = SessionTable(self.pool, self.new_verifier, limits, metrics=self.metrics)
        self.check = Checks(target.cfg.vocab_size, model_fingerprint, self.pool)
        self.metrics.kv_blocks.set(self.pool.num_blocks)
        # Weakly: the batcher's threads reach this gauge, and would hold the pool and the engine through it.
        pool_ref = weakref.ref(self.pool)
        self.metrics.kv_blocks_used.set_function(lambda: p.used_blocks if (p := pool_ref()) is not None else 0)
        self.batcher = RoundBatcher(
            target, window_s=c.batch_window_s, max_batch=c.max_batch, on_batch=self.metrics.observe_batch
        )
        self.work = ModelWork(c.model_threads, c.max_model_calls_per_caller)
        self.plain = PlainDecoder(target, c, self.table, self.work, self.batcher, self.check, self.eos_ids)
        # What Generate and the HTTP API decode with: the target alone, or with drafts made here (serve --server-draft).
        self.decoding = self.plain
        if server_draft:
            if drafter is None:
                raise ValueError(SERVER_DRAFT_NEEDS_DRAFTER)
            self.decoding = ServerDraftDecoder(
                target,
                c,
                self.table,
                self.work,
                self.batcher,
                self.check,
                self.eos_ids,
                drafter=drafter,
                k=server_draft,
            )
            log.info(
                "server-draft on: Generate and the HTTP API draft %d tokens a round with the %s drafter here",
                server_draft,
                drafter.dcfg.kind,
                extra={"event": "server_draft", "k": server_draft},
            )
        # An engine dropped without close() (an embedding program's, a test's) still ends its threads, and so frees
        # its KV pool; close() is the orderly way.
        # Not at interpreter exit, though: the threads are daemons then, and ending them midway aborts the process.
        for done in (
            weakref.finalize(self, RoundBatcher.close, self.batcher),
            weakref.finalize(self, self.work.close, False),
        ):
            done.atexit = False

    @classmethod
    def build(cls, cfg: ServeConfig, *, engine_index: int | None = None) -> Engine:
        """The engine a ServeConfig describes (its flags checked by the caller: tether.server.daemon.serve), loaded
        and assembled, not yet warmed up. `engine_index`: this process's index under serve --engines."""
        kernel_dir = use_cache(cfg)
        device = pick_device(cfg.device)
        config = service_config(cfg)
        if engine_index is not None:
            config = dataclasses.replace(config, engine=engine_index)
        followers, stop_ranks, extra = [], None, {}
        if cfg.tp > 1:
            kind = "cuda" if device.startswith("cuda") else "cpu"
            followers, port = start_followers(cfg, kind, config.kv_pool_bytes, cfg.kv_block_size)
            cmd_group = join_rank0(cfg.tp, port, kind)
            device = "cuda:0" if kind == "cuda" else "cpu"
        target, tokenizer, drafter, model_fp = load_models(cfg, device)
        if cfg.tp == 1:  # sized now that the weights are in (a tensor-parallel pool was sized for the followers' start)
            free = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()  # blocks the loading cached but no longer uses count as free
                free = torch.cuda.mem_get_info(torch.device(device))
            budget = resolve_kv_pool(cfg.kv_pool_mb, cfg.kv_pool_share, device, engines=cfg.engines, mem_info=free)
            config = dataclasses.replace(config, kv_pool_bytes=budget.bytes)
            log.info(budget.note, extra={"event": "kv_pool", "kv_pool_mb": budget.bytes >> 20})
        if cfg.tp > 1:
            # The client part ships whole weights: take them before this rank keeps only its shard.
            if drafter is not None:
                part = client_part_tensors(target, drafter)
                extra["client_weights"] = {k: v.detach().cpu().clone() for k, v in part.items()}
            tp_target = TPTarget(shard(target, 0, cfg.tp), cmd_group)
            extra["pool"] = tp_target.make_pool(config.kv_pool_bytes, config.kv_block_size)
            target = tp_target

            def stop_ranks() -> None:
                stopped = tp_target.stop()
                for p in followers:
                    p.join(timeout=30 if stopped else 0)
                    if p.is_alive():
                        p.terminate()

        if cfg.cache_dir:
            extra["export_dir"] = Path(cfg.cache_dir).expanduser() / "onnx"
        chat = ChatFormat.from_model_dir(cfg.model, tokenizer)
        engine = cls(
            target,
            drafter,
            tokenizer,
            config,
            model_fingerprint=model_fp,
            chat_format=chat,
            kernel_dir=kernel_dir,
            round_graph_tokens=cfg.round_graph_tokens,
            server_draft=cfg.server_draft_k if cfg.server_draft else 0,
            **extra,
        )
        engine._stop_ranks = stop_ranks
        return engine

    # ---- start and stop --------------------------------------------------------------------------------------

    def warm_up(self) -> str:
        """serve's kernel warm-up (batcher.warm_up) on the Triton backend, then the step graphs: those an earlier run
        recorded, and with a drafter those of every batch size and width for rounds of `round_graph_tokens` tokens;
        "warm cache" when it added no file to Triton's cache (everything was there), "cold cache" when it compiled or
        tuned anything."""
        target, pool, drafter = self.target, self.pool, self.drafter
        if not (target.backend == "triton" and target.tp[1] == 1):  # a tensor-parallel target's steps run eagerly
            return "no kernel warm-up"
        from tether.kernels.utils import interpreting  # noqa: PLC0415 (the kernels only where they run)

        before, t0 = count_entries(self.kernel_dir), time.perf_counter()
        warm_up(target, pool, drafter=drafter)
        root, runner = current_dir(), self.runner
        if root is not None:  # the step graphs the last run captured (serve records them when it stops)
            n = runner.capture_shapes(load_shapes(root, self._shapes_key()), drafter=drafter)
            log.info("captured %d step graphs recorded by an earlier run", n)
        if drafter is not None and self.round_graph_tokens > 0:
            t1 = time.perf_counter()
            n = runner.capture_shapes(runner.round_shapes(self.round_graph_tokens), drafter=drafter)
            log.info(
                "captured %d step graphs for rounds of %d tokens in %.1f s",
                n,
                self.round_graph_tokens,
                time.perf_counter() - t1,
            )
        seconds, added = time.perf_counter() - t0, count_entries(self.kernel_dir) - before
        if interpreting():
            state = "interpreted kernels, nothing cached"
        else:
            state = "cold cache" if added > 0 else "warm cache"
        log.info(
            "warm-up: attention kernels compiled and tuned in %.1f s (%s: %d new files in %s, %d before)",
            seconds,
            state,
            added,
            self.kernel_dir,
            before,
            extra={"event": "warm_up", "warm_up_s": round(seconds, 2), "cache_files_added": added},
        )
        return state

    def _shapes_key(self) -> str:
        """Step graphs are captured for one model, dtype and block size."""
        ident = json.dumps([self.target.cfg.to_dict(), str(self.pool.k.dtype), self.pool.block_size], sort_keys=True)
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def record_shapes(self) -> None:
        """Keep the shapes of the step graphs captured here, for the next start's warm-up."""
        root, target = current_dir(), self.target
        if root is not None and target.backend == "triton" and target.tp[1] == 1:
            record_shapes(root, self._shapes_key(), self.runner.shapes())

    def settle(self) -> int:
        """Start-up's heap out of every later collection's walk (tether.server.heap), each pause timed; the count
        of objects frozen."""
        frozen = heap.settle()
        self._pauses = heap.GCPauses(self.metrics.gc_pause).install()
        log.info("heap settled: %d objects frozen out of the garbage collector's walks", frozen)
        return frozen

    async def housekeeping(self) -> None:
        """Expire idle sessions' leases now and then, for the server's lifetime."""
        period = min(max(self.config.session_lease_s / 4, 0.05), 10.0)
        while True:
            await asyncio.sleep(period)
            self.table.expire()

    def stop_work(self) -> None:
        self.work.stop_work()

    def release_all(self) -> None:
        self.table.close_all()

    def close(self) -> None:
        """End the engine's threads, and a tensor-parallel target's ranks (the process is stopping)."""
        if self._pauses is not None:
            self._pauses.remove()
            heap.release()
            self._pauses = None
        self.batcher.close()
        self.work.close()
        if self.exporter is not None:
            self.exporter.close()
        if self._stop_ranks is not None:
            self._stop_ranks()
            self._stop_ranks = None

    @property
    def sessions(self) -> dict[str, Session]:
        """The sessions held now, by id (a snapshot)."""
        return self.table.snapshot()

    # ---- what every handler uses ---------------------------------------------------------------------------

    async def in_thread(self, fn, *args, claim: Claim | None = None, stoppable: bool = False):
        """`fn(*args)` on a model thread (tether.server.model_work), cancelled with its call."""
        return await self.work.wait(self.work.submit(fn, *args, stoppable=stoppable), claim)

    def capacity(self, length: int, max_new: int) -> int:
        """Positions a session of `length` verified tokens and `max_new` to come is given."""
        return min(length + max_new + self.config.max_draft_tokens + 1, self.target.cfg.max_seq_len)

    def new_verifier(self, sampling: pb.SamplingParams, capacity: int) -> SequenceVerifier:
        """A session's verifier; `sampling` was checked (Checks.sampling) before."""
        generator = torch.Generator().manual_seed(sampling.seed)
        return SequenceVerifier(
            self.target,
            self.drafter,
            capacity=capacity,
            controls=sampling_controls(sampling),
            generator=generator,
            pool=self.pool,
            prefill_chunk=self.config.prefill_chunk,
            logprobs=requested_logprobs(sampling),
        )

    def need_drafter(self) -> None:
        if self.drafter is None:
            raise RequestError(
                Reason.REASON_NO_DRAFTER, "this server runs no drafter (serve --drafter none): decode with Generate"
            )

    def owned(self, session_id: str, caller: str) -> Session:
        """The caller's session of that id, or RequestError(REASON_UNKNOWN_SESSION)."""
        check_id(session_id, "session_id")
        session = self.table.lookup(session_id, caller)
        if session is None:
            raise RequestError(Reason.REASON_UNKNOWN_SESSION, "unknown session: resync with the full history")
        return session

    @staticmethod
    def check_resume_token(session: Session, token: str) -> None:
        check_id(token, "resume_token")
        if not secrets.compare_digest(token.encode(), session.resume_token.encode()):
            raise RequestError(Reason.REASON_WRONG_RESUME_TOKEN, "wrong resume token for this session")

    def encode_delta(self, delta: DraftDelta | ArrayDelta, codec: Codec) -> pb.KVDelta:
        """A delta on the wire, in bfloat16: torch tensors (prefills, absorbs), or the batcher's numpy arrays of
        bfloat16 bits (tether.server.rounds.slice_deltas), which go to the wire format as they are."""
        if isinstance(delta, ArrayDelta):
            payload = wire.encode_bf16_bundle(delta.tensors, codec)
        else:
            tensors = {k: v if v.dtype == torch.bfloat16 else v.to(torch.bfloat16) for k, v in delta.tensors.items()}
            payload = encode_many(tensors, codec)
        self.metrics.kv_delta_bytes.inc(len(payload))
        return pb.KVDelta(start=delta.start, tokens=delta.tokens, payload=payload)

    def delta_parts(self, delta: DraftDelta, codec: Codec) -> list[pb.KVDelta]:
        """A long prompt's delta goes in parts, each well under the message limit."""
        return [self.encode_delta(d, codec) for d in delta.split(self.config.max_message_bytes // 4)]

    async def client_part(self, fmt: int) -> tuple[dict, list]:
        """(entries by name, manifest) in format `fmt`; ONNX ones are exported on the exporter's thread."""
        if fmt == pb.CLIENT_PART_TOKENIZER:
            return self.tokenizer_files, self.tokenizer_manifest
        if fmt == pb.CLIENT_PART_TENSORS:
            return self.weights, self.manifest
        if fmt not in FORMATS:
            raise invalid(f"unknown client part format {fmt}")
        try:
            part = await self.exporter.part_async(FORMATS[fmt])
        except ExportError as e:
            raise RequestError(Reason.REASON_INTERNAL, str(e)) from None
        return part.files, list(part.manifest)
