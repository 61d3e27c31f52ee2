"""The stand-in's HTTP port: `StandInServer.http` behind a real socket.

`serve(servers)` runs a `ThreadingHTTPServer` on 127.0.0.1 (an ephemeral
port) that answers every request with what `StandInServer.http` gives: a
POST to `/v1/models/<name>...:predict` goes to the server of that model
(any other request to the first one, which answers it as TF Serving's HTTP
port does: a 404 for a model it does not serve, 400 for a malformed request,
libevent's 404 page outside `/v1/`).
"""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote_to_bytes

from serving_standin.server import PREDICT_PATH


def _server_for(servers, method: str, path: str):
    match = PREDICT_PATH.fullmatch(path.split("?", 1)[0]) if method == "POST" else None
    if match is not None:
        name = unquote_to_bytes(match.group(1)).decode("utf-8", "surrogateescape")
        for server in servers:
            if server.model_name == name:
                return server
    return servers[0]


class _Handler(BaseHTTPRequestHandler):
    servers: list = []
    protocol_version = "HTTP/1.1"

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        server = _server_for(self.servers, self.command, self.path)
        status, content_type, text = server.http(self.command, self.path, body)
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(servers):
    """Serve `servers` (`StandInServer`s) over HTTP on 127.0.0.1; yields
    `(host, port)`. Stopped on exit."""
    handler = type("Handler", (_Handler,), {"servers": list(servers)})
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    http.daemon_threads = True
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield http.server_address[:2]
    finally:
        http.shutdown()
        http.server_close()
        thread.join(timeout=30)
