"""A fault-injecting HTTP proxy for the GCS emulator (tests only; loopback only).

`FaultProxy(upstream)` listens on 127.0.0.1 and forwards every request to the emulator at
`upstream`; a test adds `Rule`s that answer some requests with a fault instead: a status
(503, 429, ...), a connection reset, a truncated body or a stall. Point the clients at it
with `STORAGE_EMULATOR_HOST=proxy.url` (bertjax.runtime.files points gcsfs and tensorstore there).
Every request is recorded in `proxy.seen` as `(method, path, outcome)`: the emulator's
status, or `injected FAULT` (`proxy.faults()`).
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import re
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable

FAULTS = ("status", "reset", "truncate", "stall")


@dataclasses.dataclass
class Rule:
    """Requests whose method is `method` (any if None) and whose unquoted path-and-query
    matches `path` (a regex searched) get `fault`: "status" (answered `status` without
    reaching the emulator, or after it if `forward_first`: an ambiguous failure), "reset"
    (the connection closed with a RST), "truncate" (half the emulator's body, then closed)
    or "stall" (nothing for `stall_s` seconds, then closed). Of the matching requests, the
    rule skips the first `after`, then takes every `every`-th (1: each), at most `count`
    times (None: without end)."""

    path: str = ""
    method: str | None = None
    fault: str = "status"
    status: int = 503
    count: int | None = None
    every: int = 1
    after: int = 0
    forward_first: bool = False
    stall_s: float = 60.0
    matched: int = 0
    fired: int = 0

    def takes(self, method: str, path: str) -> bool:
        if (self.method and method != self.method) or not re.search(self.path, path):
            return False
        self.matched += 1
        position = self.matched - self.after
        if (
            position <= 0
            or position % self.every
            or (self.count is not None and self.fired >= self.count)
        ):
            return False
        self.fired += 1
        return True


class FaultProxy:
    """The proxy (a context manager: started on enter, stopped on exit)."""

    def __init__(self, upstream: str):
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.rules: list[Rule] = []
        self.seen: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, **rule) -> Rule:
        """Adds `Rule(**rule)`; a request gets the fault of the first rule that takes it."""
        added = Rule(**rule)
        assert added.fault in FAULTS, added.fault
        with self._lock:
            self.rules.append(added)
        return added

    def clear(self) -> None:
        """Removes every rule (ends stalls in progress) and forgets what was seen."""
        with self._lock:
            self.rules.clear()
            self.seen.clear()
        self._stop.set()
        self._stop = threading.Event()

    def faults(self) -> list[tuple[str, str, str]]:
        """The requests that got a fault."""
        return [s for s in self.seen if s[2].startswith("injected")]

    def _rule_for(self, method: str, path: str) -> Rule | None:
        with self._lock:
            return next((r for r in self.rules if r.takes(method, path)), None)

    def _record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.seen.append((method, path, outcome))

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


def _handler(proxy: FaultProxy) -> Callable:  # noqa: C901 (one branch per fault the proxy injects)
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # (quiet)
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = b""
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return body
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
            connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in ("transfer-encoding", "connection", "content-length")
            }
            connection.request(
                self.command,
                self.path,
                body=body if body or self.command in ("POST", "PUT", "PATCH") else None,
                headers=headers,
            )
            response = connection.getresponse()
            data = response.read()
            connection.close()
            kept = [
                (k, v)
                for k, v in response.getheaders()
                if k.lower() not in ("transfer-encoding", "connection", "content-length")
            ]
            return response.status, response.reason, kept, data

        def _send(
            self,
            status: int,
            reason: str,
            headers: list[tuple[str, str]],
            data: bytes,
            length: int | None = None,
        ) -> None:
            self.send_response(status, reason)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _reset(self) -> None:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True

        def _serve(self) -> None:
            body = self._body()
            path = urllib.parse.unquote(self.path)
            rule = proxy._rule_for(self.command, path)
            if (
                rule is None
                or (rule.fault == "status" and rule.forward_first)
                or rule.fault == "truncate"
            ):
                status, reason, headers, data = self._forward(body)
            if rule is None:
                proxy._record(self.command, path, str(status))
                self._send(status, reason, headers, data)
                return
            proxy._record(
                self.command,
                path,
                f"injected {rule.fault}" + (f" {rule.status}" if rule.fault == "status" else ""),
            )
            if rule.fault == "status":
                error = b'{"error": {"code": %d, "message": "injected fault"}}' % rule.status
                self._send(rule.status, "Injected", [("Content-Type", "application/json")], error)
            elif rule.fault == "truncate":
                self._send(status, reason, headers, data[: len(data) // 2], length=len(data))
                self._reset()
            elif rule.fault == "reset":
                self._reset()
            else:
                stop, deadline = proxy._stop, time.monotonic() + rule.stall_s
                while not stop.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.close_connection = True

        def handle_one_request(self) -> None:
            try:
                self.raw_requestline = self.rfile.readline(65537)
                if not self.raw_requestline or not self.parse_request():
                    self.close_connection = True
                    return
                self._serve()
            except (TimeoutError, ConnectionError, ValueError):
                self.close_connection = True

    return Handler
