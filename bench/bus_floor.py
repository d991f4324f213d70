"""The bus's own floor under the control-plane benchmark (issue 12, item 5): the same sequence of
NATS operations a deflected request makes before its first token, done by bare nats-py processes
that do nothing else — no HTTP, no policy, no tracing, no logging, no engine.

Three processes (uvloop, one nats-py connection each, like the services) and the bundled
nats-server, on the same cores as ``bench/control_plane.py``:

* ``front`` (the ingress's part): subscribes ``out.*``; per request publishes it to a JetStream
  work-queue stream (file storage, ``Nats-Msg-Id`` dedup, as ``KAIROS_REQ``) and waits for the
  first token event;
* ``router`` (a dispatcher's part): a durable pull consumer with one lingering one-message pull;
  per request: (``--variant with-reservation``) atomically creates a reservation key with a TTL in
  a KV bucket, sends the job as a core request-reply to the worker, acks the message;
* ``worker`` (a decode agent's part): per job atomically creates a claim key in a KV bucket,
  answers the job, publishes one token event to ``out.<id>``.

Variants: ``kairos`` (queue, job, claim, token — the four sequential passes through nats-server of
a deflected request before issue 34; the name is kept so that older rows compare), ``with-reservation`` (the same plus the atomic reservation create the
dispatcher made before the job until issue 12), ``core`` (no JetStream at all: core request to
the router, core request to the worker, token — what is left without durability or claim), and the
two routes issue 34 weighed for a request path without JetStream, both on core NATS with the router
in a queue group:

* ``arbiter`` (the ingress is the arbiter — the product's path since issue 34's second step,
  docs/bus.md): the front asks a router for a decision (request-reply), then sends the job to the
  worker itself; the worker starts, publishes the token, answers. One sender per attempt, so no
  claim is needed, and the front knows the token's sender before it comes;
* ``node-asks``: the front sends the request to a router, which answers at once and sends the job to
  the worker; the worker asks the front for the right to run it (request-reply) before it starts.

:data:`PASSES` gives each variant's sequential passes through nats-server (a one-way message, or a
round trip to JetStream, each one pass) before the engine starts and before the front may relay the
first token; every row carries them. The product before issue 34, for comparison (docs/bus.md): 3
before the engine (queue, job, claim), 6 before the relay (+ reservation put, job answer, routing
event); since its second step, ``arbiter``'s 3 and 3.

Per (variant, rate) one JSON line: ``passes``, ``latency_ms`` p50/p99 (front: publish → first token
event received; the same span as ``added_ms`` in ``bench/control_plane.py`` without the ingress's
HTTP and the services' own work), ``cpu_ms_per_request`` per process kind (``nats``: the
nats-server; ``total``: their sum), ``loadavg``.

Not a test: figures depend on the machine. Usage::

    python bench/bus_floor.py [--variants kairos,with-reservation,core,arbiter,node-asks] [--rates 50,200]
                              [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

VARIANTS = ("kairos", "with-reservation", "core", "arbiter", "node-asks")
#: variant → sequential passes through nats-server before the engine starts / before the front may
#: relay the first token (module docstring); the token's own pass is not counted
PASSES = {"kairos": {"engine": 3, "relay": 3}, "with-reservation": {"engine": 4, "relay": 4},
          "core": {"engine": 2, "relay": 2}, "arbiter": {"engine": 3, "relay": 3},
          "node-asks": {"engine": 4, "relay": 4}}
#: variants whose router takes requests from a core-NATS queue group (no JetStream on the path)
CORE_VARIANTS = ("core", "arbiter", "node-asks")


async def _connect(url: str, name: str):
    import nats

    return await nats.connect(url, name=name, max_reconnect_attempts=0)


async def _router(url: str, variant: str, ready) -> None:
    import nats.errors
    from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

    nc = await _connect(url, "router")
    js = nc.jetstream()

    async def route(rid: str) -> None:
        if variant == "with-reservation":
            await resv.create(f"decode.n0.{rid}", b'{"request_id":"%s"}' % rid.encode(), msg_ttl=60)
        await nc.request("jobs.n0", rid.encode(), timeout=5)

    if variant in CORE_VARIANTS:
        async def on_req(msg) -> None:
            if variant == "arbiter":  # the decision goes back; the front sends the job
                await msg.respond(b'{"node":"n0","kind":"deflect"}')
            elif variant == "node-asks":  # taken at once; the job goes out; the node asks the front
                await msg.respond(b"taken")
                await route(msg.data.decode())
            else:
                await route(msg.data.decode())
                await msg.respond(b"ok")
        await nc.subscribe("req.core", queue="routers", cb=on_req)
        await nc.flush()
        ready.set()
        await asyncio.Event().wait()
    await js.add_stream(StreamConfig(name="REQ", subjects=["req.new"], retention=RetentionPolicy.WORK_QUEUE,
                                     storage=StorageType.FILE, max_age=600, duplicate_window=120))
    resv = await js.create_key_value(bucket="resv", history=1, limit_marker_ttl=1.0)
    sub = await js.pull_subscribe("req.new", durable="routers", stream="REQ",
                                  config=ConsumerConfig(ack_wait=5, max_deliver=5))
    ready.set()

    async def handle(msg) -> None:
        try:
            await route(msg.data.decode())
            await msg.ack()
        except Exception as exc:  # a bench: say what broke
            print(f"router: {exc!r}", file=sys.stderr)

    tasks: set = set()
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        for m in msgs:
            t = asyncio.create_task(handle(m))
            tasks.add(t)
            t.add_done_callback(tasks.discard)


async def _worker(url: str, variant: str, ready) -> None:
    nc = await _connect(url, "worker")
    js = nc.jetstream()
    claims = None if variant in CORE_VARIANTS else await js.create_key_value(bucket="claims", history=1)

    async def on_job(msg) -> None:
        rid = msg.data.decode()
        if variant == "node-asks":  # the right to run this attempt, from the front that owns it
            if (await nc.request(f"grant.{rid}", b"n0", timeout=5)).data != b"yes":
                await msg.respond(b'{"accepted":false}')
                return
        if variant == "arbiter":  # the engine starts first; the answer follows the token
            await nc.publish(f"out.{rid}", b'{"type":"tokens","first_index":0,"count":1}')
            await msg.respond(b'{"accepted":true}')
            return
        if claims is not None:
            try:
                await claims.create(f"{rid}.claim", b'{"node":"n0"}')
            except Exception as exc:  # a bench: say what broke
                print(f"worker: {exc!r}", file=sys.stderr)
                return
        await msg.respond(b'{"accepted":true}')
        await nc.publish(f"out.{rid}", b'{"type":"tokens","first_index":0,"count":1}')

    await nc.subscribe("jobs.n0", cb=on_job)
    await nc.flush()
    ready.set()
    await asyncio.Event().wait()


def _serve(role: str, url: str, variant: str, ready) -> None:
    import uvloop

    uvloop.run((_router if role == "router" else _worker)(url, variant, ready))


async def _front(url: str, variant: str, rate: float, duration_s: float) -> list[float]:
    nc = await _connect(url, "front")
    js = nc.jetstream()
    waiting: dict[str, tuple[float, asyncio.Future]] = {}

    async def on_out(msg) -> None:
        w = waiting.pop(msg.subject.rpartition(".")[2], None)
        if w is not None:
            w[1].set_result(time.perf_counter() - w[0])

    await nc.subscribe("out.*", cb=on_out)
    granted: set[str] = set()
    acks: list[asyncio.Future] = []  #: arbiter: the jobs' answers, received as the ingress would

    async def on_grant(msg) -> None:  # node-asks: the first node to ask runs the attempt
        rid = msg.subject.partition(".")[2]
        await msg.respond(b"no" if rid in granted else b"yes")
        granted.add(rid)

    await nc.subscribe("grant.*", cb=on_grant)
    await nc.flush()

    run = os.urandom(4).hex()  # every run its own ids: JetStream drops a Nats-Msg-Id it has seen

    async def one(i: int) -> float:
        rid = f"r{i}-{run}"
        fut = asyncio.get_running_loop().create_future()
        waiting[rid] = (time.perf_counter(), fut)
        if variant == "arbiter":  # decision, then the job from here; its answer is not waited for
            await nc.request("req.core", rid.encode(), timeout=5)
            acks.append(asyncio.ensure_future(nc.request("jobs.n0", rid.encode(), timeout=5)))
        elif variant in CORE_VARIANTS:
            await nc.request("req.core", rid.encode(), timeout=5)
        else:
            await js.publish("req.new", rid.encode(), stream="REQ", headers={"Nats-Msg-Id": rid}, timeout=5)
        return (await asyncio.wait_for(fut, 10)) * 1000.0

    n = max(1, int(rate * duration_s))
    t0 = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    out = await asyncio.gather(*tasks)
    await asyncio.gather(*acks)
    await nc.close()
    return list(out)


def server_pid(url: str) -> int | None:
    """The pid of the nats-server listening on ``url``'s port (its command line names ``-p <port>``),
    None if none is found here (a server on another host)."""
    port = url.rpartition(":")[2]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if argv and argv[0].endswith(b"nats-server") and b"-p" in argv and port.encode() in argv:
            return int(proc.name)
    return None


def run_variant(url: str, variant: str, rates: list[float], duration_s: float) -> list[dict]:
    """Start router and worker for ``variant``, replay each rate from this process; one row per rate."""
    import numpy as np
    import uvloop

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from control_plane import cpu_seconds

    ctx = mp.get_context("spawn")
    procs, rows = [], []
    nats_pid = server_pid(url)
    try:
        for role in ("router", "worker"):
            ready = ctx.Event()
            p = ctx.Process(target=_serve, args=(role, url, variant, ready), daemon=True)
            p.start()
            if not ready.wait(30):
                raise RuntimeError(f"{role} did not start")
            procs.append((role, p))
        uvloop.run(_front(url, variant, 20.0, 1.0))  # warm-up (connections, consumer, buckets)
        for rate in rates:
            load1 = os.getloadavg()[0]
            c0 = {role: cpu_seconds(p.pid) for role, p in procs}
            n0 = cpu_seconds(nats_pid) if nats_pid else None
            t0 = os.times()
            lat = uvloop.run(_front(url, variant, rate, duration_s))
            t1 = os.times()
            n = len(lat)
            cpu = {role: round((cpu_seconds(p.pid) - c0[role]) * 1000.0 / n, 3) for role, p in procs}
            cpu["front"] = round((t1.user + t1.system - t0.user - t0.system) * 1000.0 / n, 3)
            if n0 is not None:
                cpu["nats"] = round((cpu_seconds(nats_pid) - n0) * 1000.0 / n, 3)
            cpu["total"] = round(sum(cpu.values()), 3)
            rows.append({"variant": variant, "offered_rps": rate, "requests": n, "passes": PASSES[variant],
                         "latency_ms": {"p50": round(float(np.percentile(lat, 50)), 3),
                                        "p99": round(float(np.percentile(lat, 99)), 3)},
                         "cpu_ms_per_request": cpu, "loadavg": round(load1, 2)})
    finally:
        for _, p in procs:
            p.terminate()
            p.join(5)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"Comma list of {', '.join(VARIANTS)}.")
    ap.add_argument("--rates", default="50,200", help="Comma list of offered request rates (req/s).")
    ap.add_argument("--duration", type=float, default=10.0, help="Seconds per rate.")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    rates = [float(x) for x in args.rates.split(",")]

    from contextlib import ExitStack

    from kairos.cli.up import start_bundled_nats

    for variant in variants:
        with ExitStack() as stack:
            url = start_bundled_nats(stack, "kairos-busfloor-")
            for row in run_variant(url, variant, rates, args.duration):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
