"""The tether server as one edge session reaches it: the replicas and channel, the metadata every call carries, the
server's ModelInfo, and the server session the generation holds with its Session stream.

Contract:
- `ServerLink(cfg)`: a random affinity key of this generation goes with every call (AFFINITY_HEADER: a load
  balancer hashing it, Envoy's ring hash, keeps the session on one replica) and picks the first endpoint of
  `cfg.server`'s list, which spreads clients; the API key goes as a bearer token. `stub` is the one in use;
  `replicas.failover()` moves to the next endpoint.
- `model_info(backoff, deadline, on_wait)`: GetModelInfo, asked once (tether.client.transport.first_contact: a
  server still starting is waited for until `deadline`; a wrong address is Unreachable at once); `info` after.
- The server session: `hold(session_id, resume_token)` after an open or a resync (a rebuilt session has new ids);
  `new_stream()` a Session stream in place of the one held, `drop_stream()` closes it; `close_session()` closes the
  server session held (best effort: unreachable, it expires) and forgets it; `close()` that, then the channel.

Tests: tests/e2e (every generation), tests/deploy/test_deploy_envoy.py (affinity through Envoy).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import grpc

from tether.client.session_types import ClientConfig
from tether.client.transport import Backoff, Hint, Replicas, SessionStream, first_contact
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

AFFINITY_HEADER = "x-tether-affinity"  # per-generation key for load balancers' session affinity
CLOSE_TIMEOUT_S = 2.0  # a Close is best effort: a session nobody closes expires on the server


class ServerLink:
    """One generation's way to the server; see the module docstring."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        self.affinity = secrets.token_hex(8)
        self.replicas = Replicas(
            cfg.server,
            int(self.affinity, 16),
            keepalive_s=cfg.keepalive_s,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
        )
        auth = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()
        self.metadata = (*auth, (AFFINITY_HEADER, self.affinity))
        self.info: pb.ModelInfo | None = None  # GetModelInfo's answer (model_info())
        self.info_s = 0.0  # the time that answer took (the call that got it: a round trip, a connection's setup too)
        self.stream: SessionStream | None = None
        self.session_id = self.resume_token = ""

    @property
    def stub(self) -> tether_pb2_grpc.TetherStub:
        return self.replicas.stub

    def model_info(self, backoff: Backoff, deadline: float, on_wait: Callable[[Hint], None]) -> pb.ModelInfo:
        """The server's ModelInfo, asked once (see the module docstring)."""
        if self.info is None:

            def ask() -> pb.ModelInfo:
                t0 = time.monotonic()
                info = self.stub.GetModelInfo(
                    pb.GetModelInfoRequest(), metadata=self.metadata, timeout=max(0.1, deadline - time.monotonic())
                )
                self.info_s = time.monotonic() - t0
                return info

            self.info = first_contact(
                ask,
                backoff,
                address=self.replicas.address,
                tls=bool(self.cfg.tls_ca),
                deadline=deadline,
                on_wait=on_wait,
            )
        return self.info

    def hold(self, session_id: str, resume_token: str) -> None:
        self.session_id, self.resume_token = session_id, resume_token

    def new_stream(self) -> SessionStream:
        """A new Session stream in place of the one held, which is closed: an open or attach that failed leaves its
        stream behind, and each would keep a gRPC thread waiting on it for good."""
        self.drop_stream()
        self.stream = SessionStream(self.stub, self.metadata)
        return self.stream

    def drop_stream(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def close_session(self) -> None:
        """Close the server session held and its stream, and forget its ids."""
        self.drop_stream()
        if self.session_id:
            self.close_other(self.session_id)
        self.session_id = self.resume_token = ""

    def close_other(self, session_id: str) -> None:
        """Close a server session this link does not hold (a saved one), if the server still has it."""
        try:
            self.stub.Close(pb.CloseRequest(session_id=session_id), metadata=self.metadata, timeout=CLOSE_TIMEOUT_S)
        except grpc.RpcError:
            pass  # gone already, or unreachable: the server evicts an idle session in time

    def close(self) -> None:
        self.close_session()
        self.replicas.close()
