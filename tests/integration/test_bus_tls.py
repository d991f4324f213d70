"""NATS over TLS with a private CA and client certificates (mutual TLS), combined with the per-role
users: a real nats-server and certificates made by the ``openssl`` command for this test."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import time

import nats
import nats.errors
import pytest

from kairos.services.ingress.config import IngressConfig
from kairos.runtime.bus import BusAuthError, connect_service, flush_barrier, tls_context
from kairos.contracts.permissions import GeneratedAuth
from tests.integration.conftest import running_nats

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1, and a client certificate, all signed by the CA."""
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca-key.pem", "-out", "ca.pem", "-days",
             "1", "-subj", "/CN=kairos-test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-key.pem", "-out", f"{name}.csr",
                 "-subj", f"/CN=kairos-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d


@pytest.fixture(scope="module")
def tls_nats(certs, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls-nats")
    auth = GeneratedAuth.for_nodes(["decode-0"])
    conf = d / "nats.conf"
    conf.write_text(auth.server_config() + f"""
tls {{
  cert_file: "{certs / 'server.pem'}"
  key_file: "{certs / 'server-key.pem'}"
  ca_file: "{certs / 'ca.pem'}"
  verify: true
}}
""")
    with running_nats(d / "js", "-c", str(conf)) as port:
        yield f"tls://127.0.0.1:{port}", auth.passwords


def cfg(url: str, passwords: dict, certs, **tls) -> IngressConfig:
    return IngressConfig(nats_url=url, nats_user="ingress", nats_password=passwords["ingress"], **tls)


async def test_service_connects_with_private_ca_and_client_certificate(tls_nats, certs):
    url, pw = tls_nats
    c = cfg(url, pw, certs, nats_tls_ca_file=str(certs / "ca.pem"), nats_tls_cert_file=str(certs / "client.pem"),
            nats_tls_key_file=str(certs / "client-key.pem"))
    nc = await connect_service(c, "tls-test")
    try:
        got: list[bytes] = []

        async def cb(msg) -> None:
            got.append(msg.data)

        await nc.subscribe("kairos.view", cb=cb)  # the ingress may read the views
        await flush_barrier(nc)
        aggregator = await nats.connect(url, user="aggregator", password=pw["aggregator"],
                                        inbox_prefix="_INBOX.aggregator", tls=tls_context(c))
        await aggregator.publish("kairos.view", b"over-tls")
        await flush_barrier(aggregator)
        deadline = time.monotonic() + 5
        while not got:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert got == [b"over-tls"]
        assert nc.connected_url.scheme == "tls"
        await aggregator.close()
    finally:
        await nc.close()


async def test_without_a_client_certificate_or_trust_in_the_ca_the_connection_fails(tls_nats, certs):
    url, pw = tls_nats
    no_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))  # trusts the server, presents nothing
    with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
        await nats.connect(url, user="ingress", password=pw["ingress"], tls=no_cert, allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)
    system_cas = ssl.create_default_context()  # does not know the private CA
    system_cas.load_cert_chain(str(certs / "client.pem"), str(certs / "client-key.pem"))
    with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
        await nats.connect(url, user="ingress", password=pw["ingress"], tls=system_cas, allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)


def test_unusable_tls_files_are_config_errors_naming_the_variable(tmp_path, certs):
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(BusAuthError, match="KAIROS_NATS_TLS_CA_FILE"):
        tls_context(cfg("tls://x:1", {"ingress": "p"}, certs, nats_tls_ca_file=str(tmp_path / "junk.pem")))
    with pytest.raises(BusAuthError, match="KAIROS_NATS_TLS_CERT_FILE"):
        tls_context(cfg("tls://x:1", {"ingress": "p"}, certs, nats_tls_ca_file=str(certs / "ca.pem"),
                        nats_tls_cert_file=str(tmp_path / "junk.pem"), nats_tls_key_file=str(tmp_path / "junk.pem")))
    from kairos.runtime.envconfig import ConfigError
    with pytest.raises(ConfigError, match="KAIROS_NATS_TLS_KEY_FILE"):
        cfg("tls://x:1", {"ingress": "p"}, certs, nats_tls_cert_file=str(certs / "client.pem"))
