"""kairos.cli.coload: the profile's co-load keeps a vLLM server's queue full of distinct prefills.

Truth: what an HTTP server (a stand-in for vLLM's ``/v1/completions``, stdlib ``http.server``)
received — request count, prompt lengths, token ids, one output token each."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kairos.cli.coload import CoLoad


class _Server:
    def __init__(self, status: int = 200, want: int = 6) -> None:
        self.bodies: list[dict] = []
        self.headers: list[str | None] = []
        self.enough = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                outer.headers.append(self.headers.get("Authorization"))
                if len(outer.bodies) >= want:
                    outer.enough.set()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"choices": [{"text": "x"}]}')

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_co_load_sends_distinct_random_prompts_of_one_output_token_until_stopped():
    srv = _Server()
    try:
        load = CoLoad(srv.url, {"Authorization": "Bearer k"}, "kairos-vllm", vocab_size=50,
                      min_prompt_tokens=5, max_prompt_tokens=9, concurrency=2, seed=3).start()
        assert srv.enough.wait(10), "the co-load sent fewer than 6 requests in 10 s"
        stats = load.stop()
        n = len(srv.bodies)
        assert stats["requests"] == n >= 6 and stats["errors"] == 0
        assert stats["prompt_tokens"] == sum(len(b["prompt"]) for b in srv.bodies)
        assert stats["concurrency"] == 2 and stats["prompt_lengths"] == [5, 9]
        for b in srv.bodies:
            assert b["model"] == "kairos-vllm" and b["max_tokens"] == 1
            assert 5 <= len(b["prompt"]) <= 9 and all(3 <= t < 50 for t in b["prompt"])
        assert len({tuple(b["prompt"]) for b in srv.bodies}) == n  # no two alike: no prefix-cache hits
        assert set(srv.headers) == {"Bearer k"}
        assert len(srv.bodies) == n  # stopped: nothing more is sent
    finally:
        srv.close()


def test_a_refusing_server_is_counted_not_hammered_and_stop_still_returns():
    srv = _Server(status=500, want=1)
    try:
        load = CoLoad(srv.url, {}, "m", vocab_size=50, min_prompt_tokens=4, max_prompt_tokens=4, concurrency=1).start()
        assert srv.enough.wait(10)
        stats = load.stop()
        assert stats["requests"] == 0 and stats["errors"] >= 1 and "500" in stats["last_error"]
        # one thread waits 0.5 s after each error: far fewer requests than a tight loop would send
        assert len(srv.bodies) <= 2 * max(stats["seconds"], 0.5) / 0.5 + 1
    finally:
        srv.close()


@pytest.mark.parametrize("kw", [dict(min_prompt_tokens=0, max_prompt_tokens=4), dict(min_prompt_tokens=5, max_prompt_tokens=4),
                                dict(concurrency=0), dict(vocab_size=3)])
def test_co_load_refuses_settings_that_cannot_run(kw):
    args = {"min_prompt_tokens": 1, "max_prompt_tokens": 4, "concurrency": 1, "vocab_size": 10, **kw}
    with pytest.raises(ValueError):
        CoLoad("http://127.0.0.1:1", {}, "m", **args)
