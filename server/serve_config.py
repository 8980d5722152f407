"""`tether-server serve`'s configuration: one frozen dataclass, the flags it maps onto, and the service limits it
implies.

Contract: `ServeConfig` holds every flag of `serve` (and, for `WARM_FIELDS`, of `warm`), a comment per field; the CLI
(tether.server.cli) builds its argparse flags from the fields, `CHOICES` and `TYPES`. `service_config(cfg)` is the
ServiceConfig (the limits every handler checks) it implies, its positive values checked; `model_name(cfg)` the name in
ModelInfo and /v1/models. Every entry point that builds an engine (serve, warm, engine processes, generate, the
benches) starts from a ServeConfig (tether.server.engine_core).

    cfg = ServeConfig(model="deploy/models/target", kv_pool_mb=512)
    config = service_config(cfg)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tether.server.model_loading import DTYPES, default_model_dir
from tether.server.pool_budget import DEFAULT_SHARE, resolve_kv_pool
from tether.shared.cli_support import host, port, port_or_off


@dataclass(frozen=True)
class ServiceConfig:
    max_sessions: int = 256  # sessions held at once; past it the least recently used idle one is evicted
    max_prompt_tokens: int = 1536  # longest prompt accepted
    max_draft_tokens: int = 64  # draft tokens per round
    max_new_tokens: int = 1024  # default and upper bound of a session's generation length
    max_message_bytes: int = 4 << 20  # gRPC message limit both ways
    model_id: str = "tether-default"  # reported in ModelInfo
    api_keys: frozenset[str] = frozenset()  # accepted bearer keys; empty = no authentication (loopback use)
    max_sessions_per_key: int = 64  # sessions one key may hold at once
    max_calls_per_key: int = 512  # calls one key may have in flight at once (with api_keys)
    max_streams: int = 4096  # Session and Generate streams open at once, over all callers
    session_lease_s: float = 300.0  # a session idle this long expires: its quota and KV go back
    stream_idle_s: float = 120.0  # a Session stream that sends nothing this long is closed (its session stays)
    batch_window_s: float = 0.0  # extra wait for more rounds before each step (0: continuous batching)
    max_batch: int = 128  # rounds per step at most (the largest step bucket)
    kv_pool_bytes: int = 256 << 20  # memory of the paged KV pool all sessions share
    kv_block_size: int = 16  # positions per KV block
    prefill_chunk: int = 2048  # prompt / resync-history positions per prefill forward (bounds attention memory)
    model_threads: int = 2  # threads for prefills, resync absorbs and Generate steps
    max_model_calls_per_caller: int = 128  # calls of one key (or, without keys, one host) waiting for those threads
    engine: int | None = None  # with serve --engines: this process's index, written into its session ids
    # A CUDA engine's GIL switch interval (sys.setswitchinterval; 0: leave Python's 5 ms). The batcher lets the GIL go
    # at every CUDA call of a step and waits up to this long to get it back from the busy event loop: on an H100 at
    # 128 clients, 0.1 ms against 5 ms gave 4,626-4,703 rounds/s against 3,723-3,758 (BENCHMARKS.md, issue #44).
    gil_switch_s: float = 1e-4

    def max_new(self, requested: int) -> int:
        """A generation's length: what it asked for (0: the server's limit), at most max_new_tokens."""
        return min(requested or self.max_new_tokens, self.max_new_tokens)


@dataclass(frozen=True)
class ServeConfig:
    model: str = str(default_model_dir())  # target model directory, or a hub id in the local Hugging Face cache
    revision: str = ""  # the hub revision (branch, tag or commit) when --model is a hub id; empty: main
    drafter: str = str(default_model_dir("drafter"))  # drafter directory trained for that target; "none": no drafter
    host: str = "127.0.0.1"  # address to listen on
    port: int = 50051  # port to listen on (0 = any free port)
    device: str = ""  # "cpu" / "cuda"; empty = cuda when present
    dtype: str = ""  # weights and activations; empty = bfloat16 on CUDA, float32 on CPU
    attention: str = "auto"  # attention backend; auto = the Triton MoDA kernels on CUDA, the reference elsewhere
    # Past either bound the least recently used idle session is evicted; on a GPU the pool, sized from the free
    # memory, is what bounds them.
    max_sessions: int = 1024  # sessions held at once
    max_sessions_per_key: int = 64  # sessions one API key may hold at once
    session_lease_s: float = 300.0  # a session idle this long expires: its quota and KV memory go back
    stream_idle_s: float = 120.0  # a Session stream that sends nothing this long is closed (its session stays)
    max_streams: int = 4096  # Session and Generate streams open at once, over all callers
    max_model_calls_per_caller: int = 128  # calls of one key (without keys, one host) waiting for the model threads
    api_keys: str = ""  # file with one API key per line ('#' comments); empty = no authentication
    metrics_port: int = 0  # Prometheus metrics over HTTP on host:metrics_port; 0 = off
    tls_cert: str = ""  # PEM certificate: serve over TLS (with tls_key)
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mTLS)
    grace_s: float = 5.0  # seconds in-flight calls get to finish on shutdown
    # Past the pool the least recently used idle sessions are evicted. Auto: --kv-pool-share of the device's free
    # memory once the models are loaded, split over --engines (256 MB off CUDA): tether.server.pool_budget.
    kv_pool_mb: int = 0  # MB of the paged KV pool all sessions share; 0 = auto (a share of the free device memory)
    kv_pool_share: float = DEFAULT_SHARE  # with --kv-pool-mb 0: the part of the free device memory the pool takes
    kv_block_size: int = 16  # positions per KV block
    prefill_chunk: int = 2048  # prompt / resync-history positions per prefill forward (bounds attention memory)
    tp: int = 1  # tensor-parallel ranks: one process per GPU, rank 0 speaks gRPC (gloo ranks on CPU)
    log_format: str = "text"  # json: one JSON object per line with session ids (for log pipelines)
    log_level: str = "info"  # the least severe log records written
    cache_dir: str = ""  # keeps compiled kernels + autotuning across restarts (DIR/triton); empty = Triton's default
    # The ONNX client part is exported on its first request, per precision, and kept in DIR/onnx with --cache-dir.
    onnx_precisions: str = ""  # export these before the port opens: a comma list of fp32, fp16, int8 (e.g. fp32,int8)
    http_host: str = "127.0.0.1"  # address of the OpenAI-compatible HTTP API
    http_port: int = -1  # port of the OpenAI-compatible HTTP API: -1 = off, 0 = any free port
    http_max_streams: int = 256  # HTTP generations at once; past it requests get 429 with Retry-After
    http_max_n: int = 8  # choices (n) one HTTP request may ask for; each is a generation of http_max_streams
    served_model_name: str = ""  # name in ModelInfo and /v1/models; empty: tether-default, or the model folder's name
    round_graph_tokens: int = 6  # capture at start the step graphs of rounds this long (k + 1), all batches; 0 = none
    frontends: int = 0  # gRPC in this many front-end processes sharing the port, the models here; 0 = in this process
    # Several engine processes on the device, each with a copy of the models, its share of the KV pool and sessions;
    # the front ends route each session's calls to the engine holding it (tether.server.engines). Needs frontends.
    engines: int = 1  # engine processes (the host work of one process bounds rounds/s before the GPU does)
    # Speculative decoding entirely on the server (tether.server.server_draft): exact, as plain decoding is.
    server_draft: bool = False  # Generate and the HTTP API draft with the drafter here and verify with the target
    server_draft_k: int = 5  # with --server-draft: draft tokens per round


# The fields that take one of a fixed set of values, and those whose values a function checks (the CLI's flags).
CHOICES = {
    "dtype": ("", *DTYPES),
    "attention": ("auto", "triton", "reference", "sdpa"),
    "log_format": ("text", "json"),
    "log_level": ("debug", "info", "warning", "error"),
}
TYPES = {
    "host": host("--port"),
    "http_host": host("--http-port"),
    "port": port,
    "metrics_port": port,
    "http_port": port_or_off,
}

# The flags of `tether-server warm`: what decides which kernels the warm-up compiles, and where they go.
WARM_FIELDS = (
    "model",
    "revision",
    "drafter",
    "device",
    "dtype",
    "attention",
    "kv_pool_mb",
    "kv_pool_share",
    "kv_block_size",
    "prefill_chunk",
    "cache_dir",
    "round_graph_tokens",
    "log_format",
    "log_level",
)


SERVER_DRAFT_NEEDS_DRAFTER = "--server-draft drafts with the drafter on the server: give it one, not --drafter none"


def check_server_draft(cfg: ServeConfig) -> None:
    """--server-draft's combinations, refused before anything loads (ValueError)."""
    if not cfg.server_draft:
        return
    if cfg.drafter == "none":
        raise ValueError(SERVER_DRAFT_NEEDS_DRAFTER)
    if cfg.server_draft_k < 1:
        raise ValueError(f"--server-draft-k is at least 1 draft token a round, got {cfg.server_draft_k}")
    if cfg.tp > 1:  # the drafter's TLI layers are the target's, which a tensor-parallel rank holds a shard of
        raise ValueError("--server-draft runs with --tp 1 only: the drafter uses the target's layers unsharded")


def read_api_keys(path: str) -> frozenset[str]:
    if not path:
        return frozenset()
    keys = [ln.strip() for ln in Path(path).read_text().splitlines()]
    keys = frozenset(k for k in keys if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no API keys")
    return keys


def service_config(cfg: ServeConfig) -> ServiceConfig:
    for name in (
        "max_sessions",
        "max_sessions_per_key",
        "max_streams",
        "max_model_calls_per_caller",
        "session_lease_s",
        "stream_idle_s",
    ):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    check_server_draft(cfg)
    # Auto is the CPU's fixed default here: the engine sizes the pool from the device's free memory once the models
    # are loaded (pool_budget.resolve_kv_pool). Both flags are checked here, before anything loads.
    pool = resolve_kv_pool(cfg.kv_pool_mb, cfg.kv_pool_share, "cpu", engines=cfg.engines)
    return ServiceConfig(
        max_sessions=cfg.max_sessions,
        api_keys=read_api_keys(cfg.api_keys),
        model_id=model_name(cfg),
        max_sessions_per_key=cfg.max_sessions_per_key,
        session_lease_s=cfg.session_lease_s,
        stream_idle_s=cfg.stream_idle_s,
        max_streams=cfg.max_streams,
        max_model_calls_per_caller=cfg.max_model_calls_per_caller,
        kv_pool_bytes=pool.bytes,
        kv_block_size=cfg.kv_block_size,
        prefill_chunk=cfg.prefill_chunk,
    )


def model_name(cfg: ServeConfig) -> str:
    """--served-model-name (serve sets it to the hub id of a --model given as one), else "tether-default" for the
    default models, else the model directory's name."""
    if cfg.served_model_name:
        return cfg.served_model_name
    model = Path(cfg.model).resolve()
    return "tether-default" if model == default_model_dir().resolve() else model.name
