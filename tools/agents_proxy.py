"""A logging reverse proxy: what a coding agent sends to an OpenAI- or Anthropic-compatible server.

    python tools/agents_proxy.py --upstream http://127.0.0.1:8000 --port 8001 --out /tmp/claude

Every request is forwarded unchanged to the upstream server and answered with its response
(streams pass through chunk by chunk); each one is also written to OUT/NN.json (01, 02, ...):
method, path, headers without credentials, the JSON body (or its text), and the response's
status and first bytes. The files are the raw material of tests/fixtures/agents/ (scrubbed by
hand there). Standard library only, so it runs wherever the agents do.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
               "proxy-connection", "te", "trailer"}
RESPONSE_HEAD = 4000  # characters of each response body kept in the log


def loggable_body(raw: bytes) -> Any:
    """The body as JSON when it parses, else as text ("" when empty)."""
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


class RequestLog:
    """Numbered JSON files in one folder; thread-safe (agents send requests in parallel)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.lock = folder, threading.Lock()
        self.counter = itertools.count(1 + len(list(folder.glob("[0-9][0-9].json"))))

    def write(self, record: dict[str, Any]) -> Path:
        with self.lock:
            path = self.folder / f"{next(self.counter):02d}.json"
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        return path


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive towards the agent; chunked answers
    upstream: tuple[str, int] = ("127.0.0.1", 8000)
    log: RequestLog

    def do_GET(self) -> None:
        self.forward()

    do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = do_GET

    def forward(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        record = {"method": self.command, "path": self.path,
                  "headers": {k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS},
                  "body": loggable_body(body)}
        conn = http.client.HTTPConnection(*self.upstream)  # no read timeout: a long prefill is silent for minutes
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
        except OSError as e:  # upstream down: the agent sees a 502, the log says why
            record["response"] = {"status": 502, "body_head": f"upstream error: {e}"}
            self.send_error(502, f"upstream error: {e}")
        else:
            record["response"] = {"status": resp.status, "body_head": ""}
            try:
                self.relay(resp, record["response"])
            except (BrokenPipeError, ConnectionResetError):  # the agent hung up (an aborted request)
                record["response"]["client_closed"] = True
                self.close_connection = True
            except OSError as e:  # the upstream broke off mid-answer
                record["response"]["error"] = f"upstream error: {e}"
                self.close_connection = True
        finally:
            conn.close()
            self.log.write(record)

    def relay(self, resp: http.client.HTTPResponse, logged: dict[str, Any]) -> None:
        """Send the upstream response on, chunk by chunk; its first characters go to logged["body_head"]."""
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        if self.command == "HEAD" or resp.status in (204, 304):  # no body may follow
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        head = bytearray()
        while chunk := resp.read1(65536):
            if len(head) < RESPONSE_HEAD:
                head += chunk[:RESPONSE_HEAD - len(head)]
                logged["body_head"] = head.decode("utf-8", errors="replace")
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the files are the log
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", default="http://127.0.0.1:8000", help="the server to forward to")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="port to listen on (0: any free one)")
    p.add_argument("--out", type=Path, required=True, help="folder for the NN.json request logs")
    args = p.parse_args(argv)
    up = urlsplit(args.upstream)
    ProxyHandler.upstream = (up.hostname or "127.0.0.1", up.port or 80)
    ProxyHandler.log = RequestLog(args.out)
    server = ThreadingHTTPServer((args.host, args.port), ProxyHandler)
    print(f"proxy on http://{args.host}:{server.server_address[1]} -> {args.upstream}, logs in {args.out}",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
