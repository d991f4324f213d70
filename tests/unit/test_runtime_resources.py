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
