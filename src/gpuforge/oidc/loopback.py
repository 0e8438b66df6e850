"""The browser's way back to `gpuforge login` (RFC 8252, 7.3): a one-request HTTP server on 127.0.0.1 at a
free port, that the provider redirects the browser to with the authorization code.

Only a redirect that carries this sign-in's `state` ends the wait; any other request to the port (another
local process guessing it) is answered 400 and ignored. Nothing it receives is used but the code and the
provider's error, and those only as strings sent back to the provider or shown.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlsplit

from gpuforge.oidc.flows import SignInFailed

CALLBACK_PATH = "/callback"
PAGE = "<!doctype html><title>gpuforge</title><p>{}</p>"


@dataclass
class _Outcome:
    code: str | None = None
    error: str | None = None


class LoopbackReceiver:
    """Listens on 127.0.0.1 from its creation; `wait(state, timeout_s)` gives the code. Use it as a
    context manager, so the port is closed whatever happens."""

    def __init__(self):
        self._server = HTTPServer(("127.0.0.1", 0), _Handler)
        self._server.outcome = None
        self._server.expected_state = None

    @property
    def redirect_uri(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{CALLBACK_PATH}"

    def wait(self, state: str, timeout_s: float) -> str:
        """The code of the redirect that carries `state`; SignInFailed on the provider's error or when
        `timeout_s` passes first."""
        self._server.expected_state = state
        deadline = time.monotonic() + timeout_s
        while self._server.outcome is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SignInFailed(f"no answer from the browser in {timeout_s:g} s: run gpuforge login again")
            self._server.timeout = min(left, 1.0)
            self._server.handle_request()
        outcome = self._server.outcome
        if outcome.error:
            raise SignInFailed(f"the provider refused the sign-in: {outcome.error}")
        return outcome.code

    def close(self) -> None:
        self._server.server_close()

    def __enter__(self) -> LoopbackReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # a connection that sends nothing does not hold the port for good

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        expected = self.server.expected_state
        state = query.get("state", "")
        if (
            parts.path != CALLBACK_PATH
            or not expected
            or not hmac.compare_digest(state.encode(), expected.encode())
        ):
            return self._answer(400, "This is not the sign-in gpuforge is waiting for.")
        if "error" in query:
            error = query["error"][:100] + (
                f" ({query['error_description'][:300]})" if "error_description" in query else ""
            )
            self.server.outcome = _Outcome(error=error)
            return self._answer(400, "The sign-in was refused; see the terminal.")
        if not query.get("code"):
            return self._answer(400, "The redirect carries no code.")
        self.server.outcome = _Outcome(code=query["code"])
        self._answer(200, "Signed in to gpuforge: you may close this tab.")

    def _answer(self, status: int, text: str) -> None:
        body = PAGE.format(text).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # the query holds the code: never on the terminal
