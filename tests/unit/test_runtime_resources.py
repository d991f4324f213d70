"""kairos.runtime.resources: close steps run last-first, failures are logged and never stop the rest."""

import asyncio

import pytest

from kairos.runtime.resources import BackgroundTasks, Resources


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, event, **kw):
        self.lines.append((event, kw))


async def test_close_steps_run_in_reverse_and_a_failing_step_is_logged_not_raised():
    log, order = Log(), []

    async def closing(name):
        order.append(name)

    def broken():
        order.append("broken")
        raise RuntimeError("boom")

    res = Resources(log)
    res.push("nats", lambda: closing("nats"))
    res.push("broken", broken)
    res.push("http", lambda: closing("http"))
    await res.aclose()
    await res.aclose()  # idempotent
    assert order == ["http", "broken", "nats"]
    assert log.lines == [("close_step_failed", {"step": "broken", "error": "RuntimeError('boom')"})]


async def test_a_pushed_task_is_cancelled_and_awaited_at_close():
    started = asyncio.Event()

    async def forever():
        started.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(forever())
    await started.wait()
    res = Resources(Log())
    res.push_task("watcher", task)
    await res.aclose()
    assert task.cancelled()


async def test_a_failed_background_task_is_logged_with_its_name_and_a_cancelled_one_is_not():
    log = Log()
    bg = BackgroundTasks(log)

    async def fails():
        raise ValueError("lost")

    t = bg.spawn(fails(), "timing_record")
    with pytest.raises(ValueError):
        await t
    await asyncio.sleep(0)  # let the done callback run (it is scheduled by the loop, not awaited)
    assert log.lines == [("background_task_failed", {"task": "timing_record", "error": "ValueError('lost')"})]
    assert len(bg) == 0
    blocker = bg.spawn(asyncio.Event().wait(), "waiter")
    await bg.cancel_all()
    assert blocker.cancelled() and len(log.lines) == 1


async def test_drain_lets_the_tasks_that_end_in_time_finish_and_cancels_the_rest():
    bg = BackgroundTasks(Log())
    release = asyncio.Event()

    async def quick():
        await release.wait()
        return "done"

    finishing = bg.spawn(quick(), "quick")
    stuck = bg.spawn(asyncio.Event().wait(), "stuck")
    release.set()
    await bg.drain(timeout_s=0.05)  # the stuck task is cancelled after 0.05 s, the quick one finished
    assert finishing.result() == "done" and stuck.cancelled() and len(bg) == 0


class _Service:
    def __init__(self, fail_start: bool) -> None:
        self.fail_start, self.calls = fail_start, []

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise ConnectionError("no NATS")

    async def close(self) -> None:
        self.calls.append("close")


@pytest.mark.parametrize("fail_start", [False, True])
async def test_run_service_closes_the_service_after_serving_and_after_a_failed_start(fail_start):
    from kairos.runtime.service import run_service

    svc, stop = _Service(fail_start), asyncio.Event()
    stop.set()
    if fail_start:
        with pytest.raises(ConnectionError):
            await run_service(svc, stop)
    else:
        await run_service(svc, stop)
    assert svc.calls == ["start", "close"]


async def test_a_manual_clock_moves_only_when_slept_on_or_a_wait_times_out():
    from kairos.runtime.clock import ManualClock

    clock = ManualClock(now_ms=1000.0, monotonic=5.0)
    await clock.sleep(0.25)
    assert (clock.now_ms(), clock.monotonic()) == (1250.0, 5.25)
    event = asyncio.Event()
    assert await clock.wait_event(event, 2.0) is False and clock.monotonic() == 7.25
    event.set()
    assert await clock.wait_event(event, 2.0) is True and clock.monotonic() == 7.25
    assert clock.slept == [0.25, 2.0]
