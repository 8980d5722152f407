"""grpc.health.v1 probe for the tether-server image's HEALTHCHECK (grpc_health_probe without the extra binary).

Usage: python3 healthcheck.py [HOST:PORT] [SERVICE]      exit 0 when SERVING, 1 otherwise (unreachable, slow, other)
Defaults: 127.0.0.1:50051 and "tether.v1.Tether". When the server speaks TLS, set TETHER_HEALTH_TLS_CA (PEM CA
bundle), and TETHER_HEALTH_TLS_CERT / TETHER_HEALTH_TLS_KEY for mTLS; TETHER_HEALTH_TLS_NAME overrides the name the
certificate is checked against (default: the host). TETHER_HEALTH_TIMEOUT_S: deadline in seconds (default 3).
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(var: str) -> bytes | None:
    path = os.environ.get(var, "")
    return open(path, "rb").read() if path else None


def check(address: str, service: str, timeout_s: float) -> bool:
    ca = _read("TETHER_HEALTH_TLS_CA")
    if ca is None:
        channel = grpc.insecure_channel(address)
    else:
        creds = grpc.ssl_channel_credentials(ca, _read("TETHER_HEALTH_TLS_KEY"), _read("TETHER_HEALTH_TLS_CERT"))
        name = os.environ.get("TETHER_HEALTH_TLS_NAME", "")
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(address, creds, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {service or '(server)'} is {status}", file=sys.stderr)
        return False
    return True


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else "127.0.0.1:50051"
    service = argv[2] if len(argv) > 2 else "tether.v1.Tether"
    return 0 if check(address, service, float(os.environ.get("TETHER_HEALTH_TIMEOUT_S", "3"))) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
