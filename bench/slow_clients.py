"""How long slow-header clients (slowloris) hold ingress connections.

Starts a bundled nats-server and one ingress (defaults: ``KAIROS_HEADER_TIMEOUT_S`` = 10 s), opens
``--connections`` connections that each send a request line and one header and then nothing, and
prints when the ingress closed them (a sentence on stderr, one JSON line on stdout). Not a test: it prints measured figures (docs/security.md).

    .venv/bin/python bench/slow_clients.py --connections 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kairos.services.ingress.config import IngressConfig  # noqa: E402
from kairos.services.ingress.service import Ingress  # noqa: E402
from kairos.cli.up import start_bundled_nats  # noqa: E402


async def measure(nats_url: str, n: int, header_timeout_s: float) -> None:
    ing = Ingress(IngressConfig(nats_url=nats_url, port=0, header_timeout_s=header_timeout_s, log_level="error"))
    await ing.start()
    try:
        t0 = time.monotonic()
        conns = [await asyncio.open_connection("127.0.0.1", ing.port) for _ in range(n)]
        for _, w in conns:
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            await w.drain()

        async def closed(reader: asyncio.StreamReader) -> float:
            await reader.read()
            return time.monotonic() - t0

        ts = await asyncio.gather(*(asyncio.wait_for(closed(r), header_timeout_s + 60) for r, _ in conns))
        dropped = ing.m.slow_clients._value.get()
        print(f"{n} slow-header connections, header timeout {header_timeout_s:g} s: all closed by the ingress; "
              f"first after {min(ts):.2f} s, last after {max(ts):.2f} s; "
              f"kairos_ingress_slow_clients_dropped_total = {dropped:.0f}", file=sys.stderr)
        print(json.dumps({"connections": n, "header_timeout_s": header_timeout_s, "closed": len(ts),
                          "first_closed_s": round(min(ts), 3), "last_closed_s": round(max(ts), 3),
                          "dropped_counter": dropped}))
    finally:
        await ing.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=300)
    ap.add_argument("--header-timeout-s", type=float, default=IngressConfig.header_timeout_s)
    args = ap.parse_args()
    with ExitStack() as stack:
        url = start_bundled_nats(stack, "kairos-slow-")
        asyncio.run(measure(url, args.connections, args.header_timeout_s))


if __name__ == "__main__":
    main()
