"""``kairos bench``'s failure summary (kairos/cli/bench/report.py ``error_groups``,
``failure_lines``): failures are grouped by the error's code (the server's OpenAI-style error
``code``/``type``, ``HTTP <status>`` without one, the exception class for client-side failures), each
group printed with its count and one example, then how many failures the printed lines leave out,
so the counts add up to the failed total. A new user's trial saw 46 failures printed as one
``25 x ClientConnectorError`` line and four single ``ingress_shutdown`` lines (19 of them were
ingress_shutdown, but each message embeds its request id, so none grouped) and no "and N more"."""

from __future__ import annotations

import json
import re

from aiohttp import web
from click.testing import CliRunner

from kairos.cli.bench.report import failure_lines
from kairos.cli.main import main
from tests.unit.fake_openai import PL_CLOSE, FakeOpenAI, serve, write_csv

PL_SHUTDOWN, PL_LOST, PL_502 = 21, 22, 23
PL_CODES = {24: "c1", 25: "c2", 26: "c3"}


class FailingFake(FakeOpenAI):
    """The fake OpenAI server, with errors whose messages embed the request id, as the ingress's do."""

    async def _respond(self, r: web.Request, body: dict, leave) -> web.StreamResponse:
        n = len(body["prompt"])
        if n not in (PL_SHUTDOWN, PL_LOST, PL_502, *PL_CODES):
            return await super()._respond(r, body, leave)
        self.n += 1
        rid = f"cmpl-{self.n:04d}"
        if n == PL_SHUTDOWN:
            return web.json_response({"error": {"message": f"the ingress serving request {rid} is shutting down; "
                                                           "retry the request", "type": "ServiceUnavailableError",
                                                "code": "ingress_shutdown"}}, status=503)
        if n == PL_502:
            return web.Response(text=f"<html>bad gateway for {rid}</html>", status=502)
        if n in PL_CODES:
            return web.json_response({"error": {"message": f"request {rid} refused", "type": "BadRequestError",
                                                "code": PL_CODES[n]}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        chunk = {"id": rid, "choices": [{"index": 0, "text": "t0 ", "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        err = {"error": {"message": f"node decode-0 serving {rid} was lost", "type": "ServiceUnavailableError",
                         "code": "node_lost"}}
        await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
        return resp


def test_failures_are_grouped_by_code_and_the_printed_counts_add_up(tmp_path):
    lengths = [PL_SHUTDOWN] * 4 + [PL_LOST] * 2 + [PL_502, *PL_CODES, PL_CLOSE] + [10, 11]
    csv = write_csv(tmp_path / "wl.csv", [(k * 0.001, n, 3) for k, n in enumerate(lengths)])
    out = tmp_path / "b.json"
    with serve(FailingFake()) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url, "--no-progress", "--workload", f"trace:{csv}",
                                        "--json", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["failed"] == 11 and rep["completed"] == 2
    groups = {g["code"]: g for g in rep["error_groups"]}
    assert sum(g["count"] for g in rep["error_groups"]) == rep["failed"]
    assert groups["ingress_shutdown"]["count"] == 4 and groups["node_lost"]["count"] == 2
    assert groups["HTTP 502"]["count"] == 1 and all(groups[c]["count"] == 1 for c in PL_CODES.values())
    assert re.match(r"HTTP 503: the ingress serving request cmpl-\d+ is shutting down", groups["ingress_shutdown"]
                    ["example"])
    assert len(groups) == 7  # + the client-side failure of the dropped connection (its exception class)
    assert rep["error_groups"][0]["code"] == "ingress_shutdown"  # the main cause first

    lines = res.stderr[res.stderr.index("sent 13, completed 2, failed 11"):].splitlines()[1:]
    printed = [ln for ln in lines if re.match(r"  \d+ x ", ln)]
    assert printed[0].startswith("  4 x ingress_shutdown: HTTP 503: the ingress serving request cmpl-")
    assert printed[1].startswith("  2 x node_lost: node decode-0 serving cmpl-")
    assert len(printed) == 5
    more = next(ln for ln in lines if "more failure" in ln)
    left_out = int(re.search(r"and (\d+) more failures of 2 other kinds", more).group(1))
    assert sum(int(ln.split(" x ")[0]) for ln in printed) + left_out == rep["failed"]


def test_failure_lines_say_nothing_is_left_out_when_all_groups_fit_and_read_old_reports():
    groups = [{"code": "ingress_shutdown", "count": 3, "example": "x" * 300}, {"code": "TimeoutError", "count": 1,
                                                                              "example": "timeout after 5 s"}]
    lines = failure_lines({"error_groups": groups, "failed": 4})
    assert lines == [f"  3 x ingress_shutdown: {'x' * 199}…", "  1 x TimeoutError: timeout after 5 s"]
    old = failure_lines({"errors": {f"m{k}": 1 for k in range(7)}, "failed": 7})  # a report saved before groups
    assert old[:2] == ["  1 x m0", "  1 x m1"] and old[-1] == "  … and 2 more failures of 2 other kinds " \
                                                              "(all in --json's error_groups)"
