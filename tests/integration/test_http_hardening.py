"""HTTP hardening of the ingress against raw sockets and a real nats-server (one whose
``max_payload`` is 64 KiB, so a prompt too large for the bus is cheap to build).

Each test would fail on the ingress before the hardening: slow-header clients were held until
aiohttp's keep-alive timeout (3630 s), protocol errors were ``text/plain``, a 1 MB model name
came back in a 1 MB body, a 500 named the exception, 503s had no ``Retry-After``, and a prompt
over the bus's payload limit was a 503 ``enqueue_failed``.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time

import aiohttp
import pytest

from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.app import IngressApp
from kairos.services.ingress.service import Ingress
from tests.integration.conftest import reset_bus, running_nats

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"
SMALL_PAYLOAD = 64 * 1024


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("small-nats")
    conf = d / "nats.conf"
    conf.write_text(f"max_payload: {SMALL_PAYLOAD}\n")
    with running_nats(d / "js", "-c", str(conf)) as port:
        yield f"nats://127.0.0.1:{port}"


class running:
    """An ingress alone (no dispatcher, no nodes) on a free port."""

    def __init__(self, url: str, **cfg) -> None:
        self.cfg = IngressConfig(nats_url=url, port=0, **cfg)

    async def __aenter__(self) -> Ingress:
        await reset_bus(self.cfg.nats_url)
        self.ing = Ingress(self.cfg)
        await self.ing.start()
        return self.ing

    async def __aexit__(self, *exc) -> None:
        await self.ing.close()


async def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    return out


async def one_response(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` and read one response (head + ``Content-Length`` body); the connection may stay
    open (aiohttp lingers to drain an unread request body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    n = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
    body = await asyncio.wait_for(reader.readexactly(n), timeout)
    writer.close()
    return head + body


def split_response(resp: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def assert_openai_error(body: bytes | dict, code: str | None = None) -> dict:
    obj = json.loads(body) if isinstance(body, (bytes, str)) else body
    assert set(obj) == {"error"} and {"message", "type", "param", "code"} <= set(obj["error"]), obj
    if code is not None:
        assert obj["error"]["code"] == code, obj
    return obj["error"]


async def test_slow_header_clients_are_dropped(small_nats):
    async with running(small_nats, header_timeout_s=0.5) as ing:
        t0 = time.monotonic()
        conns = [await asyncio.open_connection("127.0.0.1", ing.port) for _ in range(30)]
        for _, w in conns:
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
            await w.drain()

        async def trickle() -> bytes:  # keeps sending header bytes: still bounded by the deadline
            r, w = await asyncio.open_connection("127.0.0.1", ing.port)
            w.write(b"GET /v1/models HTTP/1.1\r\n")
            while not r.at_eof() and time.monotonic() - t0 < 10:
                try:
                    w.write(b"X-Slow: 1\r\n")
                    await w.drain()
                except ConnectionError:
                    break
                try:
                    return await asyncio.wait_for(r.read(), 0.1)
                except asyncio.TimeoutError:
                    pass
            return b""

        outs = await asyncio.gather(*(asyncio.wait_for(r.read(), 5) for r, _ in conns), trickle())
        dropped_after = time.monotonic() - t0
        assert all(o == b"" for o in outs), outs[:3]  # closed without a response
        assert dropped_after < 3.0, dropped_after
        assert ing.m.slow_clients._value.get() == 31
        async with aiohttp.ClientSession() as http:  # a normal client is still served
            async with http.get(f"http://127.0.0.1:{ing.port}/v1/models") as r:
                assert r.status == 200


async def test_slow_body_gets_408_json(small_nats):
    async with running(small_nats, body_timeout_s=0.5) as ing:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"model\": ")
        status, headers, body = split_response(await one_response(ing.port, head))
        assert status == 408 and headers["content-type"].startswith("application/json")
        assert "0.5 s" in assert_openai_error(body, "request_timeout")["message"]


@pytest.mark.parametrize("request_bytes,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 400),  # too long
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header Name: 1\r\n\r\n", 400),
])
async def test_protocol_errors_are_openai_json(small_nats, request_bytes, status):
    async with running(small_nats) as ing:
        got, headers, body = split_response(await raw(ing.port, request_bytes))
        assert got == status
        assert headers["content-type"].startswith("application/json"), headers
        err = assert_openai_error(body)
        assert err["type"] == "invalid_request_error" and len(body) < 2048
        assert "Traceback" not in body.decode() and "aiohttp" not in body.decode()


async def test_echoed_values_are_truncated(small_nats):
    async with running(small_nats) as ing, aiohttp.ClientSession() as http:
        name = "m" * 1_000_000
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions",
                             json={"model": name, "prompt": "hi"}) as r:
            body = await r.read()
            assert r.status == 404 and len(body) < 4096, len(body)
            msg = assert_openai_error(body, "model_not_found")["message"]
            assert "more characters]" in msg
        async with http.get(f"http://127.0.0.1:{ing.port}/" + "p" * 7000) as r:
            body = await r.read()
            assert r.status == 404 and len(body) < 2048, len(body)
        chat = {"model": MODEL, "messages": [{"role": "r" * 100_000, "content": "x"}]}
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/chat/completions", json=chat) as r:
            body = await r.read()
            assert r.status == 400 and len(body) < 4096, len(body)


async def test_internal_errors_name_no_exception(small_nats, monkeypatch):
    async def broken(self, _req):
        raise RuntimeError("SecretInternalDetail")

    monkeypatch.setattr(IngressApp, "models", broken)
    async with running(small_nats) as ing, aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{ing.port}/v1/models") as r:
            body = await r.read()
            assert r.status == 500
        err = assert_openai_error(body, "internal_error")
        assert "RuntimeError" not in body.decode() and "SecretInternalDetail" not in body.decode()
        assert "err-" in err["message"]  # the error id to find the log line


async def test_every_503_has_retry_after(small_nats):
    async with running(small_nats) as ing, aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{ing.port}/health") as r:  # no aggregator, no nodes
            assert r.status == 503 and r.headers.get("Retry-After") == "1"
        await ing.nc.close()  # the bus is gone: enqueueing fails
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions",
                             json={"model": MODEL, "prompt": "hi"}) as r:
            body = await r.read()
            assert r.status == 503 and r.headers.get("Retry-After") == "1"
            assert "Error" not in assert_openai_error(body, "enqueue_failed")["message"]  # no exception name


async def test_prompt_too_large_for_the_bus_is_400_naming_the_limit(small_nats):
    async with running(small_nats) as ing, aiohttp.ClientSession() as http:
        prompt = "word " * 20_000  # 100 kB: ~25k tokens by the estimate, fits the context window
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions",
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 4}) as r:
            body = await r.read()
            assert r.status == 400
        err = assert_openai_error(body, "prompt_too_large")
        assert str(SMALL_PAYLOAD) in err["message"] and err["param"] == "prompt"


async def test_body_over_the_limit_is_413_naming_it(small_nats):
    async with running(small_nats, max_body_bytes=4096) as ing, aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions",
                             json={"model": MODEL, "prompt": "x" * 10_000}) as r:
            body = await r.read()
            assert r.status == 413
        assert "4096" in assert_openai_error(body, "request_too_large")["message"]
        # gzip: the limit counts the decompressed body, and the message does not pretend the
        # (small) compressed size was too large
        packed = gzip.compress(json.dumps({"model": MODEL, "prompt": "x" * 10_000}).encode())
        assert len(packed) < 4096
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions", data=packed,
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
            body = await r.read()
            assert r.status == 413
        msg = assert_openai_error(body, "request_too_large")["message"]
        assert "4096" in msg and f"decoding the gzip body of {len(packed)} bytes" in msg, msg


async def test_api_keys_from_config_and_file(small_nats, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# ops keys\nsk-file\n\n")
    async with running(small_nats, api_keys=("sk-env",), api_key_file=str(key_file)) as ing, \
            aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{ing.port}"

        async def get(path: str, key: str | None = None, scheme: str = "Bearer"):
            headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
            async with http.get(base + path, headers=headers) as r:
                return r.status, r.headers, await r.read()

        status, headers, body = await get("/v1/models")
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert assert_openai_error(body, "invalid_api_key")["type"] == "invalid_request_error"
        status, _, body = await get("/v1/models", "sk-nope")
        assert status == 401 and b"sk-nope" not in body
        assert (await get("/v1/models", "sk-env", scheme="Basic"))[0] == 401
        assert (await get("/v1/models", "sk-env"))[0] == 200
        assert (await get("/v1/models", "sk-file"))[0] == 200
        assert (await get("/v1/requests/cmpl-x"))[0] == 401
        assert (await get("/health"))[0] == 503  # open (503: no cluster here), not 401
        assert (await get("/metrics"))[0] == 200
        async with http.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
            assert r.status == 401
        assert ing.m.auth_failures.labels("missing")._value.get() == 4  # incl. the Basic one
        assert ing.m.auth_failures.labels("invalid")._value.get() == 1


@pytest.mark.parametrize("byte", [b"\xe9", b"\xff"])
async def test_a_non_utf8_authorization_header_is_refused_with_401_on_every_protected_route(small_nats, byte):
    """``Authorization: Bearer sk-<byte>`` (not UTF-8) answered 500 internal_error with a traceback
    in the log; it is a wrong key: 401 invalid_api_key, counted as invalid."""
    async with running(small_nats, api_keys=("sk-env",)) as ing:
        routes = [(b"POST", b"/v1/completions"), (b"POST", b"/v1/chat/completions"), (b"GET", b"/v1/models"),
                  (b"GET", b"/v1/requests/cmpl-x"), (b"GET", b"/no-such-path")]
        for method, path in routes:
            body = b'{"model": "m", "prompt": "hi"}' if method == b"POST" else b""
            head = (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Authorization: Bearer sk-" + byte + b"\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            out = await raw(ing.port, head + body)
            status_line, _, rest = out.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 401"), (path, out[:300])
            assert b"WWW-Authenticate: Bearer" in rest
            assert assert_openai_error(rest.partition(b"\r\n\r\n")[2], "invalid_api_key")
        assert ing.m.auth_failures.labels("invalid")._value.get() == len(routes)


async def test_slow_second_request_on_a_kept_alive_connection_is_dropped(small_nats):
    async with running(small_nats, header_timeout_s=0.5) as ing:
        reader, writer = await asyncio.open_connection("127.0.0.1", ing.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        n = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:"))
        await reader.readexactly(n)
        assert head.startswith(b"HTTP/1.1 200")
        idle_ok = time.monotonic()
        await asyncio.sleep(0.8)  # idle between requests is the keep-alive timeout's business (75 s), not this one
        assert not reader.at_eof()
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # ... then a second head that never ends
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - idle_ok < 4.0
        writer.close()

async def test_a_body_that_is_not_what_its_content_encoding_says_is_400(small_nats, caplog):
    """... and no error in the log: the client's mistake, answered (aiohttp's lingering close read the
    broken body again and logged "Unhandled exception" with a traceback)."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with running(small_nats) as ing, aiohttp.ClientSession() as http:
        for enc in ("gzip", "deflate"):
            async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions",
                                 data=json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                                 headers={"Content-Type": "application/json", "Content-Encoding": enc}) as r:
                body = await r.read()
                assert r.status == 400, (enc, r.status, body)
            err = assert_openai_error(body, "invalid_content_encoding")
            assert enc in err["message"], err
        async with http.get(f"http://127.0.0.1:{ing.port}/v1/models") as r:  # the ingress serves on
            assert r.status == 200
    errors = [r for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_content_encoding_the_ingress_cannot_decode_is_415(small_nats):
    """br (no decoder installed): 415 naming what it reads, not a parser message telling the client
    to install a Python package."""
    async with running(small_nats) as ing, aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{ing.port}/v1/completions",
                             data=json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                             headers={"Content-Type": "application/json", "Content-Encoding": "br"}) as r:
            body = await r.read()
            assert r.status == 415, (r.status, body)
        err = assert_openai_error(body, "unsupported_content_encoding")
        assert "gzip" in err["message"] and "install" not in err["message"].lower(), err
        # aiohttp reads anything it does not decode as it is: refused before the body is read
        for headers in ({"Content-Encoding": "gzip, br"}, {"Content-Encoding": "x-gzip"},
                        {"Content-Encoding": "gzip, gzip"}, [("Content-Encoding", "gzip"), ("Content-Encoding", "br")]):
            hdrs = [("Content-Type", "application/json"), *(headers.items() if isinstance(headers, dict) else headers)]
            async with http.post(f"http://127.0.0.1:{ing.port}/v1/chat/completions",
                                 data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
                                 headers=hdrs) as r:
                body = await r.read()
                assert r.status == 415, (headers, r.status, body)
            assert_openai_error(body, "unsupported_content_encoding")


async def test_a_body_declared_too_large_is_refused_before_it_is_read(small_nats):
    """``Content-Length: 99999999999`` with no body: the ingress used to wait for the body until its
    30 s body timeout (408). It answers 413 at once, from the header, and says it closes the connection."""
    async with running(small_nats, max_body_bytes=1024 * 1024) as ing:
        resp = await one_response(ing.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                            b"Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{}",
                                  timeout=5.0)
        status, headers, body = split_response(resp)
        assert status == 413 and headers.get("connection", "").lower() == "close", resp[:300]
        err = assert_openai_error(body, "request_too_large")
        assert "1048576" in err["message"] and "99999999999" in err["message"], err


async def test_a_malformed_header_leaves_its_bytes_out_of_the_log_and_the_answer(small_nats, caplog):
    """A control byte in ``Authorization``, or a header over 8,190 bytes, is a 400 JSON answer;
    aiohttp used to log it as an error with a traceback quoting the header — the bearer token with
    it — and the answer's message quoted it back to the client (and to any proxy's log)."""
    import logging

    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with running(small_nats) as ing:
        for head in (b"Authorization: Bearer s3cr3t-t0ken\x01x", b"Authorization: Bearer s3cr3t-" + b"a" * 9000):
            resp = await raw(ing.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head
                             + b"\r\nContent-Length: 2\r\n\r\n{}")
            status, _, body = split_response(resp)
            assert status == 400, resp[:300]
            err = assert_openai_error(body)
            assert "s3cr3t" not in err["message"] and err["message"].startswith("malformed HTTP request: "), err
    logged = [r for r in caplog.records if r.name.startswith("aiohttp")]
    assert logged, "aiohttp logged nothing about the refused request"  # the check below could not fail otherwise
    for r in logged:
        text = r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
        assert "s3cr3t" not in text and r.levelno < logging.ERROR, (r.levelname, text[:500])


async def test_a_client_that_hangs_up_mid_body_is_a_disconnect_not_an_ingress_error(small_nats):
    """Headers promise 100 bytes, 8 arrive, the client closes: recorded as a 499 client disconnect
    (a new user's trial saw an ``unhandled_error`` with a traceback and an error id instead)."""
    async with running(small_nats) as ing:
        requests = ing.m.requests
        reader, writer = await asyncio.open_connection("127.0.0.1", ing.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\"")
        await writer.drain()
        writer.close()
        deadline = time.monotonic() + 10
        while requests.labels("completions", "499")._value.get() == 0:  # bounded poll of what the server saw
            assert time.monotonic() < deadline, "the hang-up was not recorded as a 499 disconnect"
            await asyncio.sleep(0.02)
        assert requests.labels("completions", "500")._value.get() == 0
