"""A minimal OpenAI-compatible HTTP front for a router served over gRPC, for the bench's tests.

This is NOT the Ray Serve ingress (deploy/app.py, which tests/test_http_api.py tests
through `specserve serve`: starting that costs minutes on a small machine, far more than
the bench's tests may add). It parses requests and builds answers with the same protocol
module (deploy/openai_api.py: body validation, specserve's extra fields, `usage` with
`drafters`, `token_ids`, errors in OpenAI's shape) and calls a real router over gRPC,
unary chat completions only, on a plain http.server in a thread. So the bench's HTTP
client is exercised end to end against real outputs and real refusals, cheaply.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from deploy import openai_api as oa
from protos import specserve_pb2_grpc as pb_grpc


@contextmanager
def http_front(router: str, model: str = "specserve-test") -> Iterator[str]:
    """http://127.0.0.1:PORT of a front to the gRPC router at HOST:PORT `router`."""
    channel = grpc.insecure_channel(router)
    stub = pb_grpc.SpecserveStub(channel)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real ingress

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [
                    {"id": model, "object": "model", "created": 0, "owned_by": "specserve"}]})
            else:
                self._send(404, oa.OpenAIError(404, f"no route {self.path}").body())

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                if self.path != "/v1/chat/completions":
                    raise oa.OpenAIError(404, f"no route {self.path}")
                req = oa.parse(oa.ChatCompletionRequest, oa.loads(raw))
                if req.model != model:
                    raise oa.OpenAIError(404, f"model {req.model!r} does not exist", "model", "model_not_found")
                if req.stream:
                    raise oa.OpenAIError(400, "stream: this test front does not stream", "stream", "invalid_value")
                rid = uuid.uuid4().hex
                outs = []
                for g in req.generate_requests(rid):
                    try:
                        outs.append(stub.Generate(g))
                    except grpc.RpcError as e:  # the field at fault as the ingress names it
                        field = dict(e.trailing_metadata() or ()).get("specserve-field")
                        refused = oa.router_error(e.code().name, e.details() or "", field)
                        req.rename(refused)
                        raise refused from e
                responses = oa.Responses(True, rid, model, req.return_token_ids)
                self._send(200, responses.whole([o.text for o in outs], [list(o.token_ids) for o in outs],
                                                [o.finish_reason for o in outs], [o.usage for o in outs]))
            except oa.OpenAIError as e:
                self._send(e.status, e.body())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        channel.close()


def post_json(url: str, body: dict, timeout: float = 240) -> tuple[int, dict]:
    """POST `body` as JSON to `url`: the status and the JSON answer, an error status's too."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
