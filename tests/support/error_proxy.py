"""A real HTTP proxy in front of a real server that fails chosen requests (tests only).

    python tests/support/error_proxy.py --upstream http://127.0.0.1:PORT --rules rules.json \\
        --record requests.jsonl

Prints ``READY <port>`` once it listens on 127.0.0.1 (an ephemeral port). Every POST
is recorded as one JSON line ``{"path", "authorization", "body"}`` and then, when a
rule of ``rules.json`` matches the last user message, answered by the proxy itself::

    {"delay_s": 0.0,
     "fail": [{"match": "text in the last user message", "status": 429,
               "times": 2,            # fail the first 2 matching requests; null = always
               "retry_after": "0",    # optional Retry-After header
               "temperature": 1.0}]}  # optional: only requests sampled at this temperature

otherwise forwarded to ``--upstream`` after ``delay_s`` (GETs are forwarded as they are).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(upstream: str, rules: dict, record_path: str):
    lock = threading.Lock()
    failed = [0] * len(rules.get("fail", []))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep the test's output clean
            pass

        def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client was killed (the crash test does that)

        def _forward(self, data: bytes | None) -> None:
            request = urllib.request.Request(upstream + self.path, data=data, method=self.command,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    self._send(response.status, response.read())
            except urllib.error.HTTPError as error:
                self._send(error.code, error.read())

        def do_GET(self):
            self._forward(None)

        def do_POST(self):
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(data or b"{}")
            with lock:
                with open(record_path, "a") as f:
                    f.write(json.dumps({"path": self.path, "body": body,
                                        "authorization": self.headers.get("Authorization")}) + "\n")
            users = [m.get("content", "") for m in body.get("messages", []) if m.get("role") == "user"]
            last_user = users[-1] if users else ""
            for k, rule in enumerate(rules.get("fail", [])):
                if rule["match"] not in last_user or (
                        "temperature" in rule and body.get("temperature") != rule["temperature"]):
                    continue
                with lock:
                    fail = rule.get("times") is None or failed[k] < rule["times"]
                    failed[k] += fail
                if fail:
                    headers = {"Retry-After": rule["retry_after"]} if "retry_after" in rule else {}
                    message = json.dumps({"error": {"message": f"injected {rule['status']}"}}).encode()
                    return self._send(rule["status"], message, headers)
            time.sleep(rules.get("delay_s", 0.0))
            self._forward(data)

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--rules", required=True)
    parser.add_argument("--record", required=True)
    args = parser.parse_args()
    with open(args.rules) as f:
        rules = json.load(f)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(args.upstream.rstrip("/"), rules, args.record))
    server.daemon_threads = True
    print(f"READY {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
