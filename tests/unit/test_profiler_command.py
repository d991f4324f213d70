"""``python -m kairos.services.profiler``: its own command (no import of the CLI), with the
running-cluster options of ``kairos profile`` — the same definitions — and a clear, bounded failure
when NATS cannot be reached; ``kairos profile``'s options mapped onto the profiling session."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROG = [sys.executable, "-m", "kairos.services.profiler"]
#: the options of profiling a node of a running cluster (kairos profile's of the same names)
RUNNING_CLUSTER = ("--node", "--nats-url", "--grid", "--name", "--version", "--out", "--records", "--publish",
                   "--no-publish", "--max-mape", "--base-profile", "--engine", "--served-model", "--label",
                   "--background", "--replay", "--replay-duration", "--replay-rps", "--connect-timeout")
#: kairos profile's own: they start processes
SELF_CONTAINED = ("--emulated", "--vllm", "--model", "--model-size", "--node-profile", "--truth-profile",
                  "--truth-scale", "--co-load", "--testbed")


def _env() -> dict[str, str]:
    """This environment without KAIROS_* settings (no credentials to log in with)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    return {**env, "PYTHONPATH": str(ROOT)}


def _flags(help_text: str) -> set[str]:
    """The options the help's option column lists (``--publish / --no-publish``: both), not those
    its help texts mention."""
    return {f for m in re.finditer(r"^  (--[\w-]+)(?: / (--[\w-]+))?", help_text, re.M) for f in m.groups() if f}


def test_help_lists_the_running_cluster_options_and_exits_0():
    res = subprocess.run([*PROG, "--help"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: python -m kairos.services.profiler [OPTIONS]")
    flags = _flags(res.stdout.split("Options:", 1)[1])
    assert set(RUNNING_CLUSTER) <= flags, set(RUNNING_CLUSTER) - flags
    assert not flags & set(SELF_CONTAINED), flags & set(SELF_CONTAINED)
    assert "are `kairos profile`'s" in " ".join(res.stdout.split())  # says where the self-contained modes are


def test_the_shared_options_have_kairos_profiles_names_defaults_and_help_texts():
    from kairos.cli.commands.profile import profile
    from kairos.services.profiler.command import profile_running_node

    cli = {p.name: p for p in profile.params}
    service = profile_running_node.params
    assert {o for p in service for o in (*p.opts, *p.secondary_opts)} == set(RUNNING_CLUSTER)
    for p in service:
        q = cli[p.name]
        assert (p.opts, p.secondary_opts, p.default, p.help, repr(p.type)) == \
            (q.opts, q.secondary_opts, q.default, q.help, repr(q.type)), p.name
    # and kairos profile keeps its self-contained options beside them
    assert set(SELF_CONTAINED) <= {o for p in profile.params for o in (*p.opts, *p.secondary_opts)}


def test_an_unreachable_nats_url_fails_with_one_clear_line_within_the_connect_timeout(tmp_path):
    """A server that accepts the TCP connection and never speaks (nats-py alone would wait 5 s per
    attempt and retry forever): exit 1 with the reason once --connect-timeout has passed, no
    traceback, nothing written."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes handshakes; nothing is ever read or sent
    port = silent.getsockname()[1]
    out = tmp_path / "never.json"
    try:
        t0 = time.monotonic()
        res = subprocess.run([*PROG, "--nats-url", f"nats://127.0.0.1:{port}", "--connect-timeout", "1.5",
                              "--out", str(out)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        silent.close()
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert res.stderr.startswith(f"python -m kairos.services.profiler: cannot connect to NATS at "
                                 f"nats://127.0.0.1:{port} within 1.5 s"), res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert 1.5 <= elapsed < 1.5 + 4.5, elapsed  # waited the timeout, then gave up (interpreter start included)
    assert not out.exists()


@pytest.mark.parametrize("args,option", [
    (["--base-profile", "no-such-profile"], "--base-profile"),
    (["--replay", "no-such-workload"], "--replay"),
    (["--out", "/proc/kairos-no-such-dir/x.json"], "--out"),
])
def test_bad_options_are_usage_errors_before_connecting(args, option):
    from click.testing import CliRunner

    from kairos.services.profiler.command import profile_running_node

    res = CliRunner().invoke(profile_running_node, ["--nats-url", "nats://127.0.0.1:1", *args])
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert option in res.output and "cannot connect" not in res.output, res.output


def test_kairos_profiles_options_become_the_sessions():
    from kairos.cli.profile import EMULATED_ENGINE_LABEL, ProfileOptions
    from kairos.engines.vllm.facts import VLLM_ENGINE_LABEL
    from kairos.services.profiler.session import NodeProfileOptions

    cluster = ProfileOptions(node="decode-3", nats_url="nats://x:4222", grid="paper", name="n", version="v",
                             max_mape=5.0, records_out="r.jsonl", replay="bursty", replay_rps=2.0, label="l",
                             background="deflect", quiet=True, connect_timeout_s=3.0, command="kairos profile x")
    assert cluster.node_options() == NodeProfileOptions(
        node="decode-3", grid="paper", background="deflect", served_model="kairos-emulated", name="n", version="v",
        max_mape=5.0, publish=True, records_out="r.jsonl", replay="bursty", replay_rps=2.0, label="l",
        engine="unknown", command="kairos profile x", quiet=True, connect_timeout_s=3.0, login=True,
        measure_engine_facts=False)
    emulated = ProfileOptions(emulated=True).node_options()
    assert (emulated.login, emulated.engine, emulated.measure_engine_facts, emulated.publish) == \
        (False, EMULATED_ENGINE_LABEL, False, False)
    vllm = ProfileOptions(vllm=True).node_options()
    assert (vllm.login, vllm.engine, vllm.measure_engine_facts, vllm.grid, vllm.served_model) == \
        (False, VLLM_ENGINE_LABEL, True, "cpu-testbed", "kairos-vllm")
    assert ProfileOptions(vllm=True, engine="mine").node_options().engine == "mine"
    assert ProfileOptions().node_options().command.startswith("kairos ")  # this process's argv otherwise


@pytest.mark.parametrize("env,args,url", [
    ({"KAIROS_NATS_URL": "nats://from-env:4222"}, [], "nats://from-env:4222"),  # as every other service
    ({"KAIROS_NATS_URL": "nats://from-env:4222"}, ["--nats-url", "nats://flag:4222"], "nats://flag:4222"),
    ({"KAIROS_NATS_URL": ""}, [], "nats://127.0.0.1:4222"),  # unset: the default
])
def test_the_nats_url_defaults_to_kairos_nats_url(monkeypatch, tmp_path, env, args, url):
    from click.testing import CliRunner

    from kairos.services.profiler import session
    from kairos.services.profiler.command import profile_running_node

    async def connect(_opts, nats_url, _base):  # stands for the session: says where it would connect
        raise RuntimeError(f"would connect to {nats_url}")

    monkeypatch.setattr(session, "profile_node", connect)
    res = CliRunner(env=env).invoke(profile_running_node, [*args, "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 1 and f"would connect to {url}\n" in res.output, (res.exit_code, res.output)
    assert "[env var: KAIROS_NATS_URL]" in " ".join(CliRunner().invoke(profile_running_node, ["--help"]).output.split())


@pytest.mark.parametrize("env,args,named", [
    ({}, ["--nats-url", "bogus"], "--nats-url"),  # typed: the flag, not the variable the user never set
    ({"KAIROS_NATS_URL": "nats://fine:4222"}, ["--nats-url", "bogus"], "--nats-url"),  # the flag wins, and is named
    ({"KAIROS_NATS_URL": "bogus"}, [], "KAIROS_NATS_URL"),  # from the environment: the variable
])
def test_a_bad_nats_url_is_named_where_it_came_from(tmp_path, env, args, named):
    """The URL check (kairos/runtime/envconfig.py) names ``KAIROS_NATS_URL``; the command names
    ``--nats-url`` when the value came from the command line. Exit 2 before any connection."""
    from click.testing import CliRunner

    from kairos.services.profiler.command import profile_running_node

    res = CliRunner(env=env).invoke(profile_running_node, [*args, "--node", "decode-0",
                                                           "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert f"python -m kairos.services.profiler: {named}: 'bogus' is not a NATS server URL" in res.output, res.output
    other = "KAIROS_NATS_URL" if named == "--nats-url" else "--nats-url"
    assert other not in res.output and "cannot connect" not in res.output, res.output


def test_kairos_profile_names_its_nats_url_flag(tmp_path):
    """``kairos profile --nats-url`` (no environment variable behind it) names the flag on a bad URL."""
    from click.testing import CliRunner

    from kairos.cli.main import main as cli

    res = CliRunner(env={"KAIROS_NATS_URL": None}).invoke(cli, ["profile", "--nats-url", "bogus", "--node", "decode-0",
                                                                "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "kairos profile: --nats-url: 'bogus' is not a NATS server URL" in res.output, res.output
    assert "KAIROS_NATS_URL" not in res.output, res.output
