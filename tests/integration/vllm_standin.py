"""A stand-in vLLM OpenAI server process for ``kairos up --engine vllm`` tests (no vLLM, no model).

``kairos up`` runs ``$KAIROS_VLLM_PYTHON -m vllm.entrypoints.openai.api_server --port N ...`` with
the engine's environment (kairos/engines/vllm/launch.py ``VllmServer``); a test points ``KAIROS_VLLM_PYTHON``
at a shell wrapper that runs this file with those arguments. It then does what the node agent
needs of a real server, as vLLM 0.32.0 does it:

* ``GET /v1/models`` (the agent's readiness check) and ``GET /health`` on 127.0.0.1:``--port``;
* every ``/v1/*`` route refuses a request without ``Authorization: Bearer <key>`` with 401 when
  ``--api-key`` or ``$VLLM_API_KEY`` sets a key (vLLM's ``AuthenticationMiddleware``,
  ``vllm/entrypoints/openai/server_utils.py``); ``/health`` stays open;
* binds a ZMQ PUB socket on ``$KAIROS_ENGINE_STATE_ADDR`` (the plugin's engine-state stream), so
  the agent sees the connection close when this process dies.

Each start writes ``$KAIROS_TEST_STANDIN_DIR/<pid>.json``: ``{"pid", "argv", "state_addr",
"api_key"}`` — what the test compares across a restart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import zmq
from aiohttp import web


def main(argv: list[str]) -> None:
    args = argv[2:] if argv[:1] == ["-m"] else argv  # "-m vllm.entrypoints.openai.api_server ..."
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="standin")
    p.add_argument("--api-key", default=None)
    opts, _ = p.parse_known_args(args)
    key = opts.api_key or os.environ.get("VLLM_API_KEY") or None
    state_addr = os.environ["KAIROS_ENGINE_STATE_ADDR"]
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(state_addr)
    record = Path(os.environ["KAIROS_TEST_STANDIN_DIR"]) / f"{os.getpid()}.json"
    record.write_text(json.dumps({"pid": os.getpid(), "argv": argv, "state_addr": state_addr, "api_key": key}))

    @web.middleware
    async def auth(request: web.Request, handler):
        if key and request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": opts.served_model_name, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(middlewares=[auth])
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=opts.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main(sys.argv[1:])
