"""kairos up's restart budget for its singletons (kairos/cli/up.py RestartBudget): at most
MAX_SINGLETON_RESTARTS restarts of one child within RESTART_WINDOW_S, so a child that dies now and
then over a long run keeps being restarted while a crash loop is given up on."""

from __future__ import annotations

from kairos.cli.supervise import MAX_SINGLETON_RESTARTS, RESTART_WINDOW_S, RestartBudget


def test_the_limit_holds_within_the_window():
    b = RestartBudget(limit=3, window_s=600.0)
    assert [b.take("agg", t) for t in (0.0, 10.0, 20.0)] == [1, 2, 3]
    assert b.take("agg", 30.0) is None  # a fourth in ten minutes: a crash loop
    assert b.take("agg", 599.0) is None
    assert b.take("nats", 30.0) == 1  # per child


def test_restarts_older_than_the_window_no_longer_count():
    b = RestartBudget(limit=3, window_s=600.0)
    for t in (0.0, 10.0, 20.0):
        b.take("agg", t)
    assert b.take("agg", 600.0) == 3  # the one at 0 s left the window: one slot again
    assert b.take("agg", 605.0) is None
    # a child dying every hour over a day is restarted every time (the old budget stopped at the 6th)
    daily = RestartBudget()
    assert all(daily.take("agg", h * 3600.0) == 1 for h in range(24))


def test_a_refused_restart_is_not_recorded_and_used_says_whether_any_happened():
    b = RestartBudget(limit=1, window_s=10.0)
    assert not b.used()
    assert b.take("agg", 0.0) == 1 and b.used()
    assert b.take("agg", 5.0) is None
    assert b.take("agg", 10.0) == 1  # the refused one at 5 s did not extend the window


def test_the_defaults():
    assert (MAX_SINGLETON_RESTARTS, RESTART_WINDOW_S) == (5, 600.0)
    b = RestartBudget()
    assert [b.take("x", float(i)) for i in range(6)] == [1, 2, 3, 4, 5, None]


def test_why_a_child_stopped_is_said_from_its_return_code():
    from kairos.cli.supervise import exit_reason

    assert exit_reason(-9) == "was killed by SIGKILL" and exit_reason(-15) == "was killed by SIGTERM"
    assert exit_reason(0) == "exited with code 0 (a clean stop: SIGTERM, SIGINT or a drain)"
    assert exit_reason(143) == "exited with code 143 (SIGTERM during its startup, or a second one during its drain)"
    assert exit_reason(1) == "exited with code 1" and exit_reason(2) == "exited with code 2"
    assert exit_reason(-200) == "was killed by signal 200" and exit_reason(250) == "exited with code 250"


def test_the_restart_backoff_doubles_from_a_tenth_of_a_second_as_dockers():
    from kairos.cli.supervise import backoff_s

    assert [backoff_s(r) for r in range(1, 6)] == [0.1, 0.2, 0.4, 0.8, 1.6]
    assert backoff_s(0) == 0.1  # a rank below 1 is the first restart's
    assert RestartBudget(limit=0).take("x", 0.0) is None  # --max-restarts 0: never restarted


def test_a_clean_stop_after_a_while_is_not_a_crash_and_an_early_or_failed_exit_is():
    """A drained node agent exits 0 after serving: started again at once, outside the budget. Exit 0
    right after its start, a non-zero code or a signal count as crashes (issue 33's trial: six
    drains in ten minutes used to leave a node down as crash-looping)."""
    from kairos.cli.supervise import MIN_UPTIME_S, clean_exit
    assert clean_exit(0, MIN_UPTIME_S) and clean_exit(0, 3600.0)
    assert not clean_exit(0, MIN_UPTIME_S - 0.1)  # a child that exits 0 at once still crash-loops
    assert not clean_exit(1, 3600.0) and not clean_exit(-9, 3600.0) and not clean_exit(143, 3600.0)
