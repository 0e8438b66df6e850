"""Real receivers on 127.0.0.1 for the notifications' tests: a webhook receiver (http.server in a thread)
that checks signatures with its own code, as a receiver written from docs/notifications.md would, and an
SMTP server (aiosmtpd) that keeps what it was handed."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def signature_holds(secret: str, header: str, body: bytes, tolerance_s: float = 300) -> bool:
    """A receiver's check of X-Gpuforge-Signature: t=<unix>,v1=<hex HMAC-SHA256 of "<t>." + body>."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    if "t" not in fields or "v1" not in fields or abs(time.time() - int(fields["t"])) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), fields["t"].encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, fields["v1"])


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class WebhookReceiver:
    """Bound to a port from the start; `listening=False` refuses connections (the port bound, nothing
    accepted) until listen(): a receiver that is down, then comes back on the same URL. `answers`: the
    statuses of its next answers (then 200 each); `stall`: it holds each answer until close()."""

    def __init__(self, listening: bool = True, answers: list[int] | None = None, stall: bool = False):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[Received] = []
        self.answers = deque(answers or [])
        self.stall, self.released = stall, threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        if listening:
            self.listen()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def listen(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if receiver.stall:
                    receiver.released.wait(30)
                with receiver._lock:
                    receiver.received.append(Received(self.path, dict(self.headers.items()), body))
                    status = receiver.answers.popleft() if receiver.answers else 200
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", receiver.url("/redirected"))
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):  # quiet
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = self.sock  # the port it held while down: the same URL
        server.server_activate()
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        else:
            self.sock.close()


class SmtpInbox:
    """An SMTP server on 127.0.0.1 (aiosmtpd) keeping each message it is handed; `login`: (user, password)
    it requires (over plain text: a test server)."""

    def __init__(self, login: tuple[str, str] | None = None):
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult

        from gpuforge.runtime.host import free_port

        self.messages: list[tuple[list[str], bytes]] = []  # (recipients, the message's bytes)
        inbox = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):  # noqa: N802 (aiosmtpd's name)
                inbox.messages.append(
                    (list(envelope.rcpt_tos), envelope.original_content or envelope.content)
                )
                return "250 OK"

        def authenticate(server, session, envelope, mechanism, auth_data):
            given = (auth_data.login.decode(), auth_data.password.decode())
            return AuthResult(success=login is not None and given == login)

        options = (
            {"authenticator": authenticate, "auth_required": True, "auth_require_tls": False} if login else {}
        )
        self.port = free_port()
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port, **options)
        self.controller.start()

    def close(self) -> None:
        self.controller.stop()
