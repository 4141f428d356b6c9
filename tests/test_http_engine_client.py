"""The HTTP engine client's connections, against a small local HTTP/1.1 server (no vLLM needed):
the calls of one update share a connection, an idle one is not reused past its limit, a request
on an idle connection the server closed goes once more on a new one, and a server that is gone
surfaces as an EngineError."""

import http.server
import json
import threading

import pytest

from delta_sync.engines import HttpEngine
from delta_sync.errors import EngineError


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, close_each: bool = False):
        self.connections, self.requests, self.close_each = 0, [], close_each
        self.closed = 0  # connections whose handler has finished (the server side is closed)
        self.changed = threading.Condition()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/prefix"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless the server says otherwise

    def setup(self):
        super().setup()
        self.server.connections += 1

    def finish(self):
        try:
            super().finish()
        finally:
            with self.server.changed:
                self.server.closed += 1
                self.server.changed.notify_all()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append((self.path, json.loads(body)))
        status = 500 if self.path.startswith("/prefix/fail") else 200
        out = json.dumps({"error": "refused here"} if status == 500 else {"results": [{"ok": True}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        if self.server.close_each:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def _closed(server: _Server, n: int) -> None:
    """Wait until the server has closed ``n`` connections (its handlers finished)."""
    with server.changed:
        assert server.changed.wait_for(lambda: server.closed >= n, timeout=30), (server.closed, n)


def _client(server: _Server) -> HttpEngine:
    engine = HttpEngine(server.url, secret="s" * 32)
    engine._engine_id = ""  # this server is no vLLM engine: the identity its calls are signed for is known
    return engine


def test_calls_share_a_connection_until_it_idles_past_the_limit(monkeypatch):
    server = _Server()
    engine = _client(server)
    try:
        for _ in range(5):
            engine.pause("keep")
        engine.resume()
        assert [p for p, _ in server.requests] == ["/prefix/pause?mode=keep"] * 5 + ["/prefix/resume"]
        assert server.connections == 1
        with pytest.raises(EngineError, match=r"HTTP 500 on /fail.*refused here"):
            engine._post("/fail")
        engine.resume()  # an error answer keeps the connection
        assert server.connections == 1
        monkeypatch.setattr(HttpEngine, "KEEPALIVE_S", 0.0)  # every idle connection is now too old
        engine.resume()
        assert server.connections == 2
        # calls from several threads at once each take a connection of their own
        monkeypatch.setattr(HttpEngine, "KEEPALIVE_S", 60.0)
        threads = [threading.Thread(target=engine.resume) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 2 <= server.connections <= 5 and len(server.requests) == 12
    finally:
        engine.close()
        server.shutdown()


def test_a_server_that_closes_connections_or_goes_away(monkeypatch):
    server = _Server(close_each=True)
    engine = _client(server)
    engine.resume()
    engine.resume()
    assert server.connections == 2 and not engine._idle  # "Connection: close" is honoured
    server.close_each = False
    # the server drops connections idle for 0.2 s; the client would still reuse them (limit 60 s)
    monkeypatch.setattr(_Handler, "timeout", 0.2)
    monkeypatch.setattr(HttpEngine, "KEEPALIVE_S", 60.0)
    engine.resume()
    assert len(engine._idle) == 1
    _closed(server, 3)  # the server dropped it (0.2 s idle); the client still holds it
    engine.resume()  # on the closed idle connection first, then once on a new one
    assert server.connections == 4 and len(server.requests) == 4  # each call arrived once
    server.shutdown()
    server.server_close()
    _closed(server, 4)  # the idle connection's handler timed out too: nothing answers any more
    with pytest.raises(EngineError, match="unreachable on /resume"):
        engine.resume()
    assert len(server.requests) == 4
    engine.close()


def test_an_engine_url_that_is_not_http_is_refused_up_front():
    with pytest.raises(ValueError, match="expected http"):
        HttpEngine("127.0.0.1:8000", secret="s" * 32)
