"""kvmesh serve's readiness check of the frontend (components/deploy/local.py ``healthy``), against a real HTTP
server on loopback: 200 is not enough, the models the graph serves must be listed (the frontend answers 200 before
it has discovered any worker)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from components.deploy.local import healthy

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def health_server(answers: list[dict]) -> Iterator[str]:
    """A real HTTP server on loopback whose n-th request gets ``answers[n % len(answers)]`` (``status``, ``body``);
    yields its /health URL."""
    turn = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = answers[turn["n"] % len(answers)]
            turn["n"] += 1
            body = json.dumps(answer["body"]).encode()
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def frontend() -> Iterator[tuple[str, dict]]:
    answer: dict = {"status": 200, "body": {"status": "healthy", "models": []}}
    with health_server([answer]) as url:
        yield url, answer


def test_ready_only_once_healthy_and_listing_every_model_of_the_graph(frontend):
    url, answer = frontend
    assert healthy(url)  # no model asked for: 200 is enough
    assert not healthy(url, {"tiny-llama"})  # 200, but it has not discovered the workers yet
    answer["status"], answer["body"] = 503, {"status": "loading", "models": [], "loading": ["tiny-llama"]}
    assert not healthy(url, {"tiny-llama"})
    answer["status"], answer["body"] = 200, {"status": "healthy", "models": ["tiny-llama"]}
    assert healthy(url, {"tiny-llama"})
    assert not healthy(url, {"tiny-llama", "other"})
    assert not healthy("http://127.0.0.1:1/health", {"tiny-llama"})  # nothing listening


@pytest.fixture
def replicated_frontend() -> Iterator[tuple[str, list[dict]]]:
    """Two frontend processes on one port, as the kernel spreads connections over them: each connection is answered
    by the next of ``answers`` in turn (replica 0, 1, 0, ...)."""
    answers: list[dict] = [
        {"status": 200, "body": {"status": "healthy", "models": ["tiny-llama"], "replica": 0, "replicas": 2}},
        {"status": 503, "body": {"status": "loading", "models": [], "loading": ["tiny-llama"], "replica": 1,
                                 "replicas": 2}},
    ]  # fmt: skip
    with health_server(answers) as url:
        yield url, answers


def test_with_replicas_every_process_must_list_the_models(replicated_frontend):
    url, answers = replicated_frontend
    seen: set[int] = set()
    # Replica 0 is ready, replica 1 still loads the tokenizer: not ready, though a probe that reached 0 says 200.
    assert not healthy(url, {"tiny-llama"}, seen)
    assert not healthy(url, {"tiny-llama"}, seen)
    assert seen == {0}
    answers[1]["status"] = 200
    answers[1]["body"] = {"status": "healthy", "models": ["tiny-llama"], "replica": 1, "replicas": 2}
    assert healthy(url, {"tiny-llama"}, seen)
    assert seen == {0, 1}
