"""Blocks of running it for real (docs/reliability.md, docs/bus.md, docs/security.md, docs/deploy.md):
the NATS cluster under SIGKILLs (``tests/faults/test_nats_cluster.py``), the mutation tier (``make
mutation``), slow HTTP clients (``bench/slow_clients.py``) and the Compose smoke run (``make
compose-smoke``).
"""

from __future__ import annotations

from tools.docgen.fmt import code_counts, command, num, one_run, pct, provenance, seconds, span
from tools.docgen.results import DocgenError, Load


def nats_cluster_failover(load: Load) -> str:
    """``tests/faults/test_nats_cluster.py``: a 3-server cluster under streaming load, every member
    SIGKILLed in turn (result ``nats-cluster-failover``, its last row; with several rows, runs in a
    row, each one's failures, cut streams and p99 TTFT delta too)."""
    r = load("nats-cluster-failover")
    if not r.rows:
        raise DocgenError("nats-cluster-failover: no rows")
    x = r.rows[-1]
    errs = f" ({code_counts(x['error_codes'])})" if x["error_codes"] else ""
    back = span(x["member_back_s"], lambda v: f"{v:.1f}")
    how = one_run(r) if len(r.rows) == 1 else f"`{command(r.meta)}`; {provenance(r)}; its last run"
    return (f"Measured ({how}): {num(x['servers'])} nats-servers, "
            f"{x['rate_rps']:g} streaming requests per second offered ({x['achieved_rps']:g} per second sent), "
            f"{num(x['kills'])} SIGKILLs — {num(x['meta_leader_kills'])} of them of the JetStream meta leader, "
            + (f"{num(x['records_leader_kills'])} of the requests bucket's raft leader (one server may be both; "
               f"the records are off the request path) — " if "records_leader_kills" in x else
               f"{num(x['req_leader_kills'])} of the member holding claim bucket 0 (one server may be both; every "
               f"member holds a claim bucket) — ")
            + f"each member restarted and current "
            f"again {back} s after its kill. Of {num(x['sent'])} requests: {num(x['completed'])} completed with "
            f"exactly the expected text, {num(x['failed'])} ended with an explicit error{errs}, "
            f"{num(x['streams_cut'])} of them after their first token (streams cut); {num(x['lost'])} lost (hung "
            f"or no error), {num(x['duplicated'])} executed twice, {num(x['wrong_text'])} with wrong text"
            + (f"; {num(x['lane_moves'])} queued on a dead member's lane and enqueued again on another" if "lane_moves" in x
               else "")
            + (f"; {num(x['route_resends'])} sent to the dispatchers again (their routing went silent)"
               if "route_resends" in x else "")
            + (f"; {num(x['jobs_unanswered'])} moved to a new attempt (their job's answer was lost)"
               if "jobs_unanswered" in x else "") + ". "
            f"p99 TTFT {x['p99_ttft_steady_s']:.2f} s before the first kill, {x['p99_ttft_failover_s']:.2f} s "
            f"(max {x['max_ttft_failover_s']:.2f} s) for the requests sent within "
            f"{x['failover_window_s']:g} s after a kill: "
            f"{x['p99_ttft_failover_s'] - x['p99_ttft_steady_s']:+.2f} s (target: at most +1 s)."
            + _runs(r.rows))


def _runs(rows: list[dict]) -> str:
    """With several runs of the test in a row: each one's failures, cut streams and p99 TTFT delta."""
    if len(rows) < 2:
        return ""
    deltas = ", ".join(f"{y['p99_ttft_failover_s'] - y['p99_ttft_steady_s']:+.2f}" for y in rows)
    return (f" All {num(len(rows))} runs in a row (this one last): failed {', '.join(num(y['failed']) for y in rows)}; "
            f"streams cut {', '.join(num(y['streams_cut']) for y in rows)}; p99 TTFT in failover minus steady "
            f"{deltas} s.")


def mutation(load: Load) -> str:
    """``bench/mutation.py`` (``make mutation``): mutants of each safety-critical module by outcome."""
    r = load("mutation")
    lines = ["| module | mutants | killed | timeout | survived | of them listed equivalent | score |",
             "|---|---|---|---|---|---|---|"]
    for x in r.rows:
        undetected = x["survived"] + x["no_tests"] + x["other"]
        lines.append(f"| `{x['module']}` | {num(x['mutants'])} | {num(x['killed'])} | {num(x['timeout'])} | "
                     f"{num(undetected)} | {num(x['equivalent'])} | {pct(x['score'], 1)} |")
    total = sum(x["mutants"] for x in r.rows)
    killed = sum(x["killed"] + x["timeout"] for x in r.rows)
    # not the recorded command's wall time: mutmut reuses the verdicts of mutants whose code and tests did
    # not change since its last run in that tree, so that time says nothing about a full run
    return (f"`make mutation` (`{command(r.meta)}`; {provenance(r)}; {num(total)} mutants, "
            f"{pct(killed / total, 1)} of them killed or timed out). "
            f"Score: (killed + timeout) ÷ (mutants − listed equivalents):\n\n" + "\n".join(lines))


def slow_clients(load: Load) -> str:
    """``bench/slow_clients.py``: when the ingress closed slow-header connections (s)."""
    r = load("slow-clients")
    x = r.rows[0]
    everyone = "all" if x["closed"] == x["connections"] else "not all"
    return (f"Measured ({one_run(r)}): {num(x['connections'])} connections that send a request line and one header "
            f"and then nothing are {everyone} closed by the ingress, between {x['first_closed_s']:.2f} s and "
            f"{x['last_closed_s']:.2f} s after they connected (`KAIROS_HEADER_TIMEOUT_S` {x['header_timeout_s']:g}), "
            f"and counted (`kairos_ingress_slow_clients_dropped_total` {num(x['dropped_counter'])}).")


def compose_smoke(load: Load) -> str:
    """``make compose-smoke`` (``ops/compose-smoke/smoke.py``, its last row): the seconds of each step and
    the burst's outcome — requests completed and failed (by error code), deflections, TTFT, the
    services SIGKILLed mid-burst and how often Docker restarted them, the checks that failed."""
    r = load("compose-smoke")
    x = r.rows[-1]
    t = x["times_s"]
    fresh = [what for what, done in (("installed Docker and Compose", x.get("installed_tools")),
                                     ("made the base image", x.get("built_base_image")),
                                     ("started dockerd", x.get("started_dockerd"))) if done]
    steps = ", ".join(f"{name} {seconds(v * 1000.0, 0)}" for name, v in t.items())
    errs = f" ({code_counts(x['errors'])})" if x["errors"] else ""
    return (f"`{command(r.meta)}` ({provenance(r)}; {seconds(r.meta['wall_s'] * 1000.0, 0)} in all"
            + (f"; this run {', '.join(fresh)}" if fresh else "") + f"). Steps: {steps}. "
            f"Of {num(x['sent'])} streaming requests {num(x['completed'])} completed and {num(x['failed'])} failed{errs}, "
            f"{num(x['deflections'])} deflected; TTFT p50 {seconds(x['ttft_ms']['p50'])}, p99 {seconds(x['ttft_ms']['p99'])}; "
            f"{' and '.join(f'`{k}`' for k in x['killed'])} SIGKILLed mid-burst and restarted by Docker "
            f"({', '.join(f'{k}: {num(v)}' for k, v in x['restarts'].items())} restarts)"
            + (f"; failed checks: {'; '.join(x['failed_checks'])}" if x["failed_checks"] else "; every check passed") + ".")


#: the churn cases in the order the table lists them, with what each does
_CHURN_CASES = {
    "decode-sigterm": "decode agent SIGTERM (a graceful stop, as Kubernetes sends)",
    "decode-sigkill": "decode agent SIGKILL",
    "decode-sigstop": "decode agent paused 5 s (SIGSTOP, SIGCONT)",
    "prefill-sigterm": "prefill agent SIGTERM (prompts of 2,000–7,000 tokens)",
    "prefill-sigkill": "prefill agent SIGKILL (prompts of 2,000–7,000 tokens)",
    "rolling-restart": "rolling restart: SIGTERM to each of the 4 agents in turn, each back before the next",
}


def churn(load: Load) -> str:
    """``bench/churn.py``: what a client sees when a node stops or dies, before issue 33 (result
    ``churn-before``: the same harness on the code before it) and now (result ``churn``)."""
    now, before = load("churn"), load("churn-before")
    if not now.rows:
        raise DocgenError("churn: no rows")
    prev = {x["case"]: x for x in before.rows}
    lines = ["| fault (one node; 10 streaming req/s for 30 s, the fault 12 s in) | before: completed of sent "
             "(failed, cut) | now: completed of sent | failed | cut | wrong text | re-submitted / migrated | "
             "largest gap of a migrated stream | late events fenced | forged |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case, what in _CHURN_CASES.items():
        x = next((r for r in now.rows if r["case"] == case), None)
        if x is None:
            continue
        p = prev.get(case)
        forged = f"; {num(p['forged'])} events taken for forged" if p and p["forged"] else ""
        was = (f"{num(p['completed'])} of {num(p['sent'])} ({num(p['failed'])}, {num(p['cut'])}{forged})" if p
               else "— (no restart then)")
        gap = f"{x['max_gap_migrated_ms'] / 1000.0:.1f} s" if x["migrated"] else "—"
        lines.append(f"| {what} | {was} | {num(x['completed'])} of {num(x['sent'])} | {num(x['failed'])} | "
                     f"{num(x['cut'])} | {num(x['wrong_text'])} | {num(x['resubmitted'])} / {num(x['migrated'])} | "
                     f"{gap} | {num(x['late_events'])} | {num(x['forged'])} |")
    return (f"Now: {one_run(now)}. Before issue 33 (the same harness on the code before it): "
            f"{one_run(before)}. Every response's text is compared with the emulated engine's own output for "
            f"its prompt; `kairos up` restarts an agent that exits (it did not before: no rolling restart "
            f"then):\n\n" + "\n".join(lines))
