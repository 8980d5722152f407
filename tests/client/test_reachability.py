"""An address where no tether server answers ends `tether-client` with one line saying what does answer there, and
exit status 1: nothing (connection refused), an HTTP/1.1 server (a wrong port), a gRPC server without tether's
service, a TLS server dialled in plaintext, a plaintext server dialled with TLS, and a TLS server whose certificate
the given CA did not sign. Each is told apart by the socket's errno and the first bytes that answer, or the gRPC
status code (tether.client.transport.diagnose), never by gRPC's message text. Servers listen on 127.0.0.1 only."""

import http.server
import shutil
import socket
import subprocess
import threading
from concurrent import futures

import grpc
import pytest

from tether.client.cli import main
from tether.client.transport import Hint, diagnose


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs; a server certificate for 127.0.0.1 signed by the first."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "2", "-subj", f"/CN=tether-test-{ca}", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=server", cwd=d)  # fmt: skip
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.pem", "-days", "2", "-extfile", "san.ext", cwd=d)  # fmt: skip
    return d


def grpc_server(tls_dir=None) -> tuple[grpc.Server, int]:
    """A gRPC server with no services at all, in plaintext or TLS."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    if tls_dir is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        pair = [((tls_dir / "server.key").read_bytes(), (tls_dir / "server.pem").read_bytes())]
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(pair))
    server.start()
    return server, port


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(address: str, *extra: str) -> list[str]:
    return ["generate", "--server", address, "--prompt", "x", "--connect-timeout-s", "0.5", *extra]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("tether-client generate:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_nothing_listening(capsys):
    address = f"127.0.0.1:{closed_port()}"
    assert diagnose(address, tls=False) == Hint.NOTHING_LISTENING
    assert main(generate(address)) == 1
    err = capsys.readouterr().err
    assert f"nothing is listening at {address} (connection refused)" in one_line(err)
    assert "waiting up to" in err  # a server not up yet is waited for, and the user is told


def test_an_http_server_on_the_port(capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert diagnose(address, tls=False) == Hint.NOT_GRPC
        assert main(generate(address)) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert "answers, but not with gRPC" in one_line(capsys.readouterr().err)


def test_a_grpc_server_that_is_not_tether(capsys):
    server, port = grpc_server()
    try:
        assert main(generate(f"127.0.0.1:{port}")) == 1
    finally:
        server.stop(None)
    assert "is a gRPC server, but not tether-server" in one_line(capsys.readouterr().err)


def test_a_tls_server_dialled_in_plaintext(pki, capsys):
    server, port = grpc_server(pki)
    try:
        assert diagnose(f"127.0.0.1:{port}", tls=False) == Hint.TLS_SERVER
        assert main(generate(f"127.0.0.1:{port}")) == 1
    finally:
        server.stop(None)
    assert "speaks TLS and this client dialled it in plaintext: pass --tls-ca" in one_line(capsys.readouterr().err)


def test_a_plaintext_server_dialled_with_tls(pki, capsys):
    server, port = grpc_server()
    try:
        assert diagnose(f"127.0.0.1:{port}", tls=True) == Hint.PLAINTEXT_SERVER
        assert diagnose(f"127.0.0.1:{port}", tls=False) is None  # the right way round: nothing to say
        assert main(generate(f"127.0.0.1:{port}", "--tls-ca", str(pki / "ca.pem"))) == 1
    finally:
        server.stop(None)
    assert "speaks plaintext and this client dialled it with TLS" in one_line(capsys.readouterr().err)


def test_a_certificate_the_ca_did_not_sign(pki, capsys):
    server, port = grpc_server(pki)
    try:
        assert main(generate(f"127.0.0.1:{port}", "--tls-ca", str(pki / "other.pem"))) == 1
    finally:
        server.stop(None)
    assert "the TLS handshake with" in one_line(capsys.readouterr().err)


def test_a_host_that_does_not_resolve():
    assert diagnose("no-such-host.invalid:50051", tls=False) == Hint.UNRESOLVED
