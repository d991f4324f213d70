"""``kairos plan``'s evaluator cache, its simulator binding, the live workload's conversion, the
emitters (rendered by kubectl kustomize / docker-compose config where installed) and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.contracts.records import IngressTiming
from kairos.contracts.wire import encode
from kairos.plan.emit import EmitError, emit_compose, emit_k8s
from kairos.plan.evaluate import (Evaluator, Outcome, PlanAborted, PlanInputs, Point, pin_trace, point_duration_s,
                                  simulate)
from kairos.plan.live import LiveWorkloadError, fetch_live_workload, workload_rows
from kairos.services.ingress.workload import workload_body

ROOT = Path(__file__).resolve().parents[2]
INPUTS = PlanInputs(workload="bursty", duration_s=20.0, profile="a100-dsv2lite",
                    params={"alpha": 1.3, "beta": 1.0, "tbt_slo_ms": 70.0, "ttft_slo_ms": 4000.0})


class Counting:
    """A stand-in simulation: the attainment encodes the point, and every call is counted."""

    def __init__(self) -> None:
        self.calls: list[Point] = []

    def __call__(self, inputs: PlanInputs, p: Point) -> Outcome:
        self.calls.append(p)
        return Outcome(p.prefill / (p.prefill + p.decode), 1.0, 2.0, 10, p.seed)


def test_the_cache_answers_the_same_inputs_and_nothing_else(tmp_path):
    pts = [Point("pd", 1, 1, 2.0, 1), Point("pd", 2, 1, 2.0, 1), Point("pd", 1, 1, 2.0, 1)]
    run = Counting()
    first = Evaluator(INPUTS, tmp_path, run=run).evaluate(pts)
    assert len(run.calls) == 2, "a duplicate in a batch is simulated once"
    again = Evaluator(INPUTS, tmp_path, run=run)
    assert again.evaluate(pts) == first and len(run.calls) == 2 and again.cached == 2
    other = Evaluator(replace(INPUTS, params={**INPUTS.params, "ttft_slo_ms": 3000.0}), tmp_path, run=run)
    other.evaluate(pts[:1])
    assert len(run.calls) == 3 and other.simulated == 1, "another SLO is another key"


def test_a_torn_cache_file_is_simulated_again(tmp_path):
    run = Counting()
    ev = Evaluator(INPUTS, tmp_path, run=run)
    p = Point("pd", 1, 1, 2.0, 1)
    ev.evaluate([p])
    (f,) = list(ev.cache_dir.glob("*.json"))
    f.write_text('{"point": ')
    Evaluator(INPUTS, tmp_path, run=run).evaluate([p])
    assert len(run.calls) == 2 and json.loads(f.read_text())["point"]["prefill"] == 1


def test_a_trace_is_pinned_so_a_change_during_the_plan_cannot_poison_the_cache(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,100,10\n")
    pinned = pin_trace(replace(INPUTS, workload=f"trace:{trace}"), tmp_path / "c")
    copy = Path(pinned.workload[6:])
    assert copy != trace and copy.suffix == ".csv" and copy.read_bytes() == trace.read_bytes()
    key = Evaluator(pinned, tmp_path / "c").cache_dir
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,900,10\n1,900,10\n")  # the file changes mid-plan
    assert copy.read_text().splitlines()[1] == "0,100,10" and Evaluator(pinned, tmp_path / "c").cache_dir == key
    assert pin_trace(INPUTS, tmp_path) is INPUTS, "a generated workload has no file to pin"


def test_a_busiest_window_of_a_trace_is_pinned_with_its_suffix(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,100,10\n")
    inputs = replace(INPUTS, workload=f"trace:{trace}:busiest")
    pinned = pin_trace(inputs, tmp_path / "c")
    assert pinned.workload.endswith(".csv:busiest") and Path(pinned.workload[6:-8]).read_bytes() == trace.read_bytes()
    assert Evaluator(pinned, tmp_path / "c").cache_dir is not None


def test_a_point_keeps_the_workloads_request_count_at_a_lower_and_a_higher_rate():
    inputs = replace(INPUTS, duration_s=120.0, base_rps=8.0)
    assert point_duration_s(inputs, 2.0) == 480.0 and point_duration_s(inputs, 16.0) == 60.0
    assert point_duration_s(inputs, 8.0 / 256) == 120.0 * 256 and point_duration_s(inputs, 8.0 * 256) == 60.0


def test_an_aborted_evaluator_refuses_more_work():
    ev = Evaluator(INPUTS, None, run=Counting())
    ev.abort()
    with pytest.raises(PlanAborted):
        ev.evaluate([Point("pd", 1, 1, 2.0, 1)])


def _outcome_field(name: str, value):
    def damage(f: Path) -> None:
        data = json.loads(f.read_text())
        f.write_text(json.dumps({**data, "outcome": {**data["outcome"], name: value}}))
    return damage


def _directory(f: Path) -> None:
    f.unlink()
    f.mkdir()


@pytest.mark.parametrize("damage", [lambda f: f.write_text("[]"), lambda f: f.write_text('{"point": null}'),
                                    _outcome_field("attainment", None), _outcome_field("ttft_p95_ms", "slow"),
                                    _directory],
                         ids=["list", "null-point", "null-attainment", "string-ttft", "directory"])
def test_a_foreign_or_damaged_cache_entry_is_simulated_again(tmp_path, damage):
    """A foreign entry, a field of the wrong type, a directory where the entry was: simulated again,
    the same outcome, nothing left behind."""
    run = Counting()
    p = Point("pd", 1, 1, 2.0, 1)
    ev = Evaluator(INPUTS, tmp_path, run=run)
    ev.evaluate([p])
    (f,) = list(ev.cache_dir.glob("*.json"))
    damage(f)
    again = Evaluator(INPUTS, tmp_path, run=run)
    assert again.evaluate([p]) == ev.evaluate([p]) and len(run.calls) == 2
    assert not list(again.cache_dir.glob("*.tmp")), "no temporary file is left behind"


def test_a_trace_workload_is_keyed_by_its_bytes(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,100,10\n")
    inputs = replace(INPUTS, workload=f"trace:{trace}")
    a = Evaluator(inputs, tmp_path / "c").cache_dir
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,10\n")
    assert Evaluator(inputs, tmp_path / "c").cache_dir != a


def test_a_point_scores_what_kairos_sim_reports_for_it(tmp_path):
    """One engine: the plan's point is `kairos sim`'s row for the same cluster, workload and seed."""
    p = Point("kairos+", 2, 2, 4.0, 1)
    o = simulate(INPUTS, p)
    r = CliRunner().invoke(main, ["sim", "--workload", "bursty", "--rps", "4", "--duration", "20", "--policy",
                                  "kairos+", "--seed", "1", "--json", str(tmp_path / "sim.json")])
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "sim.json").read_text())[0]
    assert o.attainment == pytest.approx(row["slo_attainment"]) and o.requests == row["requests"]
    assert o.deflections == row["deflections"]


def test_the_workload_body_keeps_ended_requests_in_arrival_order():
    def rec(t, done=True, status=200):
        return encode(IngressTiming(received_unix_ms=t, finished_unix_ms=t + 5 if done else None, status=status,
                                    prompt_tokens=int(t), completion_tokens=3))
    body = workload_body({"b.ingress": rec(2000.0), "a.ingress": rec(1000.0), "c.ingress": rec(3000.0, done=False),
                          "d.ingress": b"not msgpack"}, 9000.0, 60.0, False)
    assert [r["request_id"] for r in body["requests"]] == ["a", "b"]
    assert body["skipped"] == 2 and body["truncated"] is False
    assert workload_rows(body) == [(0.0, 1000, 3), (1.0, 2000, 3)]


def test_refused_requests_made_no_load():
    body = {"requests": [{"arrival_unix_ms": 0, "prompt_tokens": 5, "output_tokens": 0, "status": 400},
                         {"arrival_unix_ms": 10, "prompt_tokens": 5, "output_tokens": 2, "status": 200}]}
    assert workload_rows(body) == [(0.0, 5, 2)]
    with pytest.raises(LiveWorkloadError, match="another shape"):
        workload_rows({"requests": [{"status": 200}]})


def test_an_unreachable_ingress_is_a_clear_error(tmp_path):
    with pytest.raises(LiveWorkloadError, match="could not read the workload from the ingress at http://127.0.0.1:9"):
        fetch_live_workload("http://127.0.0.1:9/v1", 60, tmp_path / "w.csv", timeout_s=2)


def _kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed (Debian: apt-get install kubectl): the overlay cannot be rendered")
    return exe


@pytest.mark.parametrize("overlay", ["emulated", "vllm-gpu"])
def test_the_k8s_overlay_renders_the_planned_nodes_with_their_users_and_passwords(tmp_path, overlay):
    out = tmp_path / "k8s"
    emit_k8s(3, 5, out, overlay)
    r = subprocess.run([_kubectl(), "kustomize", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    # the manifest checks of tests/unit/test_k8s_manifests.py: every object against the Kubernetes schemas
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (requirements-dev.txt)")
    from tests.unit.test_k8s_manifests import K8S_VERSION
    for d in docs:
        kv.validate(d, K8S_VERSION, strict=True)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"kairos"}
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    nodes = [f"prefill-{i}" for i in range(3)] + [f"decode-{i}" for i in range(5)]
    for role, n in (("prefill", 3), ("decode", 5)):
        spec = sets[role]["spec"]
        assert spec["replicas"] == n
        vol = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == "nats-password")
        assert [i["path"] for i in vol["secret"]["items"]] == [f"agent-{role}-{i}" for i in range(n)]
        assert vol["secret"]["secretName"].startswith("nats-passwords")
    (auth,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nats-config")]
    assert all(f'"agent-{n}"' in auth["data"]["auth.conf"] for n in nodes)
    assert "cluster-0.conf" in auth["data"], "merged into the base's config map, not replacing it"
    (pw,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("nats-passwords")]
    assert {f"NATS_PASSWORD_AGENT_{n.upper().replace('-', '_')}" for n in nodes} <= set(pw["data"])
    assert "NATS_PASSWORD_INGRESS" in pw["data"]
    # every mounted password file names a key the secret has (a pod would not start otherwise)
    for s in (sets["prefill"], sets["decode"]):
        vol = next(v for v in s["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats-password")
        assert {i["key"] for i in vol["secret"]["items"]} <= set(pw["data"])


def test_emitters_refuse_a_role_without_nodes(tmp_path):
    with pytest.raises(EmitError, match="a node of each role"):
        emit_k8s(0, 3, tmp_path)
    with pytest.raises(EmitError, match="a node of each role"):
        emit_compose(2, 0, tmp_path)
    with pytest.raises(EmitError, match="no kustomize overlay"):
        emit_k8s(1, 1, tmp_path, "nope")


def test_the_compose_file_runs_exactly_the_planned_nodes(tmp_path):
    (path,) = emit_compose(1, 4, tmp_path)
    doc = yaml.safe_load(path.read_text())
    svc = doc["services"]
    nodes = ["prefill-0", "decode-0", "decode-1", "decode-2", "decode-3"]
    assert [n for n in svc if n.startswith(("prefill-", "decode-")) and "emulated" in svc[n]["profiles"]] == nodes
    ports = [svc[n]["environment"]["KAIROS_METRICS_PORT"] for n in nodes]
    assert len(set(ports)) == 5 and all(svc[n]["healthcheck"]["test"][-1].endswith(f":{p}/health")
                                        for n, p in zip(nodes, ports))
    assert svc["decode-3"]["environment"]["KAIROS_NATS_USER"] == "agent-decode-3"
    assert svc["decode-3"]["secrets"] == ["nats-agent-decode-3"] and "nats-agent-decode-3" in doc["secrets"]
    used = {x if isinstance(x, str) else x["source"] for v in svc.values() for x in v.get("secrets", [])}
    assert used <= set(doc["secrets"]), "no service is left with a secret the file no longer defines"
    assert not any(s.startswith("nats-agent-") and s not in used for s in doc["secrets"]), "no unused agent secret"
    assert {"ingress", "dispatcher-0", "state_aggregator", "nats-0"} <= set(svc), "the control plane stays"
    assert "kairos nats-auth --nodes prefill-0,decode-0,decode-1,decode-2,decode-3" in path.read_text()
    exe = shutil.which("docker-compose")
    if exe is None:
        return  # the compose tier (docker-compose config of every file) has the binary
    # a copy of the project with the planned nodes' passwords, as the file's header says to make them
    proj = tmp_path / "proj"
    shutil.copytree(ROOT / "ops", proj / "ops", ignore=shutil.ignore_patterns("secrets"))
    assert CliRunner().invoke(main, ["nats-auth", "--nodes", ",".join(nodes), "--secrets-dir",
                                     str(proj / "ops" / "secrets")]).exit_code == 0
    r = subprocess.run([exe, "--project-directory", str(proj), "-f", str(path), "--profile", "emulated",
                        "config", "--services"], capture_output=True, text=True, timeout=120, cwd=proj)
    assert r.returncode == 0, r.stderr
    assert {s for s in r.stdout.split() if s.startswith(("prefill-", "decode-"))} == set(nodes)


@pytest.mark.parametrize("args,msg", [
    (["--nodes", "1:4"], "2 <= LO <= HI"),
    (["--nodes", "4:2"], "2 <= LO <= HI"),
    (["--nodes", "2:4", "--budget", "5"], "outside --nodes 2:4"),
    (["--seeds", "1,1"], "each once"),
    (["--seeds", "a"], "comma list of integers"),
    (["--attainment", "0"], "--attainment"),
    (["--attainment", "0.9"], "0.9 is not in the range 1.0<=x<=100"),
    (["--attainment", "nan"], "not a finite number"),
    (["--workload", "lpld", "--rps", "100000", "--duration", "604800"], "a plan point would simulate"),
    (["--profile", "{badcoef}"], "wrong value"),
    (["--profile", "{badengine}"], "engine.max_num_seqs must be an integer >= 1"),
    (["--workload", "nope"], "unknown workload"),
    (["--from-live", "http://127.0.0.1:9"], "could not read the workload"),
    (["--profile", "nope"], "no profile"),
    (["--profile", "{list}"], "a JSON object"),
    (["--workload", "trace:{latin1}"], "not UTF-8"),
    (["--nodes", "2:100000"], "<= 1024"),
    (["--nodes", "2:99999999999999999999999"], "<= 1024"),
    (["--rps", "1e9"], "--rps"),
    (["--duration", "1e12"], "--duration"),
    (["--duration", "0.001", "--nodes", "2:3"], "no request arrives"),
    (["--seeds", "-1"], "from 0 to"),
    (["--noise", "inf"], "--noise"),
    (["--noise", "nan"], "not a finite number"),
    (["--heartbeat-ms", "nan"], "not a finite number"),
    (["--policy", "pd,pd"], "named twice"),
    (["--plot", "{tmp}/x.txt"], "not a .png"),
    (["--plot", ""], "not a .png"),
    (["--plot", "{file}/x.png"], "cannot create or write into"),
    (["--cache-dir", "{file}"], "is a file"),
    (["--cache-dir", "{file}/sub"], "cannot create or write into"),
    (["--emit", "k8s", "--emit-dir", "{file}/x"], "cannot create or write into"),
    (["--from-live", ""], "an empty URL"),
    (["--from-live", "not a url"], "could not read the workload"),
    (["--from-live", "http://127.0.0.1:9", "--workload", "bursty"], "drop --workload"),
    (["--from-live", "http://127.0.0.1:9", "--window", "nan"], "--window"),
    (["--from-live", "http://127.0.0.1:9", "--window", "90000"], "--window"),
])
def test_bad_input_is_a_usage_error_naming_it(args, msg, tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "latin1.csv").write_bytes(b"arrival_s,prompt_tokens,output_tokens\n0,1\xe9,2\n")
    from kairos.core.model.latency import PROFILES_DIR
    prof = json.loads((PROFILES_DIR / "a100-dsv2lite.json").read_text())
    (tmp_path / "badcoef.json").write_text(json.dumps({**prof, "decode": {**prof["decode"], "intercept_ms": "x"}}))
    (tmp_path / "badengine.json").write_text(json.dumps({**prof, "engine": {**prof.get("engine", {}),
                                                                             "max_num_seqs": -1}}))
    args = [a.format(tmp=tmp_path, file=tmp_path / "afile", list=tmp_path / "list.json",
                     latin1=tmp_path / "latin1.csv", badcoef=tmp_path / "badcoef.json",
                     badengine=tmp_path / "badengine.json") for a in args]
    r = CliRunner().invoke(main, ["plan", "--cache-dir", str(tmp_path / "c"), "--plot", str(tmp_path / "p.png"),
                                  *args])
    assert r.exit_code == 2, r.output
    assert msg in r.output


def test_a_plan_runs_end_to_end_and_a_second_run_comes_from_the_cache(tmp_path):
    args = ["plan", "--workload", "bursty", "--duration", "20", "--nodes", "2:4", "--budget", "3", "--seeds", "1,2",
            "--jobs", "1", "--cache-dir", str(tmp_path / "c"), "--plot", str(tmp_path / "p.png"),
            "--json", str(tmp_path / "plan.json"), "--emit", "k8s", "--emit-dir", str(tmp_path / "e")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    out = json.loads((tmp_path / "plan.json").read_text())
    assert [p["policy"] for p in out["policies"]] == ["pd", "kairos+"] and out["simulated"] > 0
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "e" / "k8s" / "kustomization.yaml").is_file()
    assert "best split of 3 nodes" in r.stdout and "kairos+ vs pd" in r.stdout
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "0 points simulated" in again.output
    assert json.loads((tmp_path / "plan.json").read_text())["policies"] == out["policies"]


def test_the_ceiling_misses_exactly_the_prompts_too_long_alone_and_bounds_every_cluster(tmp_path):
    """A trace of 7 short prompts and 3 of 30,000 tokens, all within a second, TTFT SLO 1 s: alone
    on an idle cluster a 200-token prompt prefills in ~26 ms, a 30,000-token one needs 15 chunks of
    at least 155 ms (the profile's own step times, independent of the simulator): the ceiling is
    7/10 on every seed, and no loaded cluster scores above it."""
    trace = tmp_path / "t.csv"
    rows = [(0.1 * i, 30000 if i in (2, 5, 8) else 200, 8) for i in range(10)]
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a:.1f},{p},{o}\n" for a, p, o in rows))
    inputs = PlanInputs(workload=f"trace:{trace}", duration_s=20.0, profile="a100-dsv2lite",
                        params={**INPUTS.params, "ttft_slo_ms": 1000.0})
    from kairos.core.model.latency import load_profile
    m = load_profile("a100-dsv2lite")
    assert m.engine.max_num_batched_tokens * 15 >= 30000 and m.prefill_step_ms(m.engine.max_num_batched_tokens, 0) > 1000 / 15
    assert m.prefill_step_ms(200, 0) < 100
    for policy in ("pd", "kairos+"):
        top = [simulate(inputs, Point(policy, 1, 1, None, s, isolated=True)).attainment for s in (1, 2)]
        assert top == [0.7, 0.7], (policy, top)
        for p, d in ((1, 1), (2, 2), (4, 4)):
            assert simulate(inputs, Point(policy, p, d, None, 1)).attainment <= 0.7, (policy, p, d)


def _alive_children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``, from /proc."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _until(condition, timeout_s: float = 60.0):
    """Poll ``condition`` until it returns something truthy (returned) or ``timeout_s`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s")


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from /proc")
def test_a_sigterm_stops_the_plan_and_its_worker_processes(tmp_path):
    """``kill PID`` (``docker stop``, systemd) is a stop like Ctrl-C: the plan exits 143 and its
    simulation workers end with it (they were left blocked on their queue, orphaned, for good)."""
    proc = subprocess.Popen([sys.executable, "-m", "kairos.cli.main", "plan", "--workload", "bursty", "--duration",
                             "60", "--nodes", "2:8", "--budget", "4", "--jobs", "2", "--no-cache", "--no-plot"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    workers: set[int] = set()
    try:
        workers = _until(lambda: (lambda c: c if len(c) >= 2 else None)(_alive_children(proc.pid)))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert "kairos plan: stopped" in proc.stderr.read()  # type: ignore[union-attr]
        _until(lambda: not any(_alive(w) for w in workers), 30.0)
    finally:
        proc.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
