"""What ``make run`` (``kairos demo``) and ``kairos bench`` tell a newcomer about a replay (issue 20).

The case of the issue: the replay announced as "(60 s)" took 139 s, sat at 720/723 for 62 s (one
request with 1,899 output tokens) without a word, and printed "Request throughput 5.21" against
12.04 offered. The progress must say what is still running and why, the summary must tell the
offered rate from the achieved throughput and explain the drain. Pure formatting functions, a
fake clock, no network.
"""

from __future__ import annotations

import io

from kairos.cli.bench.progress import ProgressReporter, Streaming, progress_line, streaming
from kairos.cli.bench.report import rates_note
from kairos.cli.demo import replay_banner


def test_while_sending_the_line_counts_sent_and_in_flight():
    assert progress_line(300, 723, 0, 25.2, sent=310) == \
        "bench: 300/723 requests done, 0 failed, 25 s elapsed (310 sent so far, 10 in flight)"


def test_after_the_last_send_the_line_names_what_the_run_waits_for():
    line = progress_line(720, 723, 0, 75.0, sent=723, sent_by_s=60.0, inflight=[
        Streaming(600, 80, 410, 5.2), Streaming(512, 1203, 1899, 21.4), Streaming(701, 0, 130)])
    assert line == ("bench: 720/723 requests done, 0 failed, 75 s elapsed; all 723 sent in the first 60 s; "
                    "3 still streaming: #512 at 1,203/1,899 output tokens (~21 s left), #600 at 80/410 (~5 s left), "
                    "#701 waiting for its first of 130")
    many = [Streaming(i, 10, 100 + i) for i in range(5)]
    assert progress_line(1, 6, 0, 9, sent_by_s=8, inflight=many).endswith(
        "5 still streaming: #4 at 10/104 output tokens, #3 at 10/103, #2 at 10/102 (+2 more)")
    assert progress_line(6, 6, 1, 9, sent_by_s=8) == \
        "bench: 6/6 requests done, 1 failed, 9 s elapsed; all 6 sent in the first 8 s"


def test_time_left_comes_from_the_requests_own_token_rate():
    s = streaming(7, 100, [(10.0, 1), (10.5, 2), (12.0, 1)])  # 3 tokens after the first in 2 s
    assert (s.index, s.tokens, s.target) == (7, 4, 100) and s.eta_s == 96 * 2.0 / 3
    assert streaming(7, 100, [(10.0, 1)]).eta_s is None and streaming(7, 100, []).tokens == 0


def test_a_long_drain_still_prints_lines_and_names_the_request():
    """The replay's case: every request sent, one left streaming, no request finishing for a minute:
    the periodic tick still prints, and the line names the request and its tokens so far."""
    now = [0.0]
    out = io.StringIO()  # not a terminal: plain lines
    rep = ProgressReporter(3, enabled=True, interval_s=10.0, stream=out, clock=lambda: now[0])
    chunks: dict[int, list] = {i: [] for i in range(3)}
    for i in range(3):
        now[0] = 20.0 * i
        rep.started(i, (5, 5, 1899)[i], chunks[i])
    announce = out.getvalue().splitlines()
    assert announce[-1].startswith("bench: 0/3 requests done, 0 failed, 40 s elapsed; all 3 sent in the first 40 s")
    now[0] = 41.0
    rep.update(0, 0)
    rep.update(0, 1)
    chunks[2] += [(41.0 + 0.05 * k, 1) for k in range(1203)]  # the long one streams on
    for t in range(42, 104):  # a minute without any request finishing
        now[0] = float(t)
        rep.tick()
    lines = out.getvalue().splitlines()[len(announce):]
    assert len(lines) >= 6, lines  # one line per 10 s although nothing finished
    assert lines[-1].startswith("bench: 2/3 requests done, 0 failed, ")
    assert "1 still streaming: #2 at 1,203/1,899 output tokens (~35 s left)" in lines[-1]


def _demo_report(**over) -> dict:
    """The numbers of the issue's `make run`."""
    report = {"sent": 723, "offered_rps": 12.04, "achieved_rps": 12.03, "first_send_s": 0.0, "send_window_s": 59.92,
              "drain_s": 79.09, "max_concurrency": None,
              "last_to_finish": {"index": 512, "output_tokens": 1899, "e2el_s": 64.2},
              "serving": {"duration": 139.01, "completed": 723, "failed": 0, "request_throughput": 5.2}}
    report.update(over)
    return report


def test_the_summary_tells_offered_from_achieved_and_explains_the_drain():
    assert rates_note(_demo_report()).splitlines() == [
        "How to read the rates (kairos bench):",
        "  Offered vs sent: the workload offered 12.04 req/s (its arrival times); 723 requests sent over",
        "    59.9 s at 12.03 req/s.",
        "  Benchmark duration 139.01 s = 0.0 s to the first arrival + 59.9 s of sending + 79.1 s of drain",
        "    (the requests still streaming after the last send; the last to finish, request #512, streamed",
        "    1,899 output tokens in 64.2 s).",
        "  Request throughput (req/s) = 723 completed ÷ 139.01 s = 5.20, over the whole duration: below the",
        "    offered rate because of the drain.",
    ]


def test_the_summary_names_each_reason_the_throughput_is_below_the_offered_rate():
    held = " ".join(rates_note(_demo_report(max_concurrency=4, achieved_rps=3.1)).split())
    assert "--max-concurrency 4 held requests back: they were sent late." in held
    failed = _demo_report()
    failed["serving"] = {**failed["serving"], "failed": 9}
    assert "below the offered rate because of 9 failed and the drain." in " ".join(rates_note(failed).split())
    late = _demo_report(first_send_s=30.0, drain_s=0.4)
    late["serving"] = {**late["serving"], "duration": 90.3, "request_throughput": 8.0}
    assert "because of the wait for the first arrival." in " ".join(rates_note(late).split())
    quick = _demo_report(drain_s=0.4)
    quick["serving"] = {**quick["serving"], "duration": 60.3, "request_throughput": 11.99}
    assert "below the offered rate" not in rates_note(quick)


def test_the_demo_announces_a_window_of_arrivals_not_a_run_length():
    line = replay_banner("azure-code:busiest", 60.0, "http://127.0.0.1:8000")
    assert "the requests arriving in 60 s" in line and "still streaming" in line
    assert "(60 s)" not in line
