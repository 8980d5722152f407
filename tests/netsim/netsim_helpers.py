"""What the netsim tests share: a threaded TCP echo server on loopback and socket helpers whose waits are bounded."""

import socket
import socketserver
import threading
import time


class EchoServer(socketserver.ThreadingTCPServer):
    """Echoes every byte back; on EOF it half-closes in turn. Records how each connection ended."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), EchoHandler)
        self.endings: list[str] = []  # "eof" or "reset", one per finished connection
        self.lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def ended(self, how: str) -> None:
        with self.lock:
            self.endings.append(how)


class EchoHandler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.settimeout(10)
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
            self.request.shutdown(socket.SHUT_WR)
            self.server.ended("eof")
        except OSError:
            self.server.ended("reset")


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes, or fewer if the peer closes first; every recv is bounded by the socket's timeout."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(65536, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer has closed or reset the connection (a recv returns EOF or fails with a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    """Poll until predicate() is true or timeout_s passes; for state that settles asynchronously."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
