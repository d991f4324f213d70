"""What a service owns while it runs, and how it lets go of it: one exit stack, one task set.

Every service (ingress, dispatcher, state aggregator, node agent, profiler) used to hand-write its
``start()``/``close()`` pair with ``try: … except Exception: pass`` around each step, and two services
had their own fire-and-forget ``_bg`` helper (one of which dropped failures). This module is the one
way to do both:

* :class:`Resources` — an :class:`contextlib.AsyncExitStack` with a name per step: ``start()`` pushes
  each thing it opened (a NATS connection, an HTTP runner, a subscription, a watcher task) right after
  opening it, ``close()`` unwinds them in reverse order. A step that fails while closing is logged
  with its name and the rest still run; nothing is silently swallowed.
* :class:`BackgroundTasks` — the tasks a service spawns and does not await at once (a lane move, a
  timing record write, a job sent). A task that ends with an exception is logged with its name;
  ``cancel_all()`` cancels what is left at close and waits for it.

Both are I/O-free helpers over asyncio; they know nothing of NATS or aiohttp (kairos.runtime is the
layer that services share, see docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Awaitable, Callable, Coroutine

import structlog

_log = structlog.get_logger("kairos.runtime")


class Resources:
    """The things a service opened, closed in reverse order by one :meth:`aclose`.

    Usage (a service's ``start()`` / ``close()``)::

        self.res = Resources(self.log)
        nc = await bus.connect(...)
        self.res.push("nats", nc.close)            # an async or sync callable, no arguments
        runner = await start_http(...)
        self.res.push("http", runner.cleanup)
        ...
        await self.res.aclose()                    # http, then nats; each failure logged, never raised

    ``push`` takes a name (it appears in the log line of a failed close step) and a callable that
    returns an awaitable or ``None``. ``aclose`` is idempotent: a second call does nothing.
    """

    def __init__(self, log: Any | None = None) -> None:
        self._stack = contextlib.AsyncExitStack()
        self._log = log if log is not None else _log
        self._closed = False

    def push(self, name: str, close: Callable[[], Awaitable[Any] | None]) -> None:
        """Register ``close`` (called with no arguments at :meth:`aclose`, last pushed first)."""

        async def step(*_exc: Any) -> bool:
            try:
                result = close()
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # logged, and the other steps still run
                self._log.warning("close_step_failed", step=name, error=repr(exc))
            return False

        self._stack.push_async_exit(step)

    def push_task(self, name: str, task: asyncio.Task) -> None:
        """Register a long-lived task (a watcher, a pull loop): cancelled and awaited at close."""

        async def cancel() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self.push(name, cancel)

    async def aclose(self) -> None:
        """Run every registered close step, last first. Idempotent; never raises but CancelledError."""
        if self._closed:
            return
        self._closed = True
        await self._stack.aclose()


class BackgroundTasks:
    """Fire-and-forget tasks whose failures are logged, never lost.

    ``spawn(coro, name)`` starts ``coro`` as a task and keeps a reference until it ends (asyncio only
    keeps weak references to tasks). A task ending with an exception logs ``background_task_failed``
    with its name and the error; a cancelled one logs nothing. :meth:`cancel_all` cancels what is
    still running and waits for it (a service's close).
    """

    def __init__(self, log: Any | None = None) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._log = log if log is not None else _log

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "background") -> asyncio.Task:
        """Start ``coro`` now; returns its task (awaitable by the caller if it wants the result)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, name))
        return task

    def _done(self, task: asyncio.Task, name: str) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.warning("background_task_failed", task=name, error=repr(exc))

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait_all(self) -> None:
        """Wait for every task running now to end (failures are logged by each task's callback)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the tasks running now to end, then :meth:`cancel_all` the rest
        (a service's draining close: finish what is in flight, within a bound)."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        await self.cancel_all()

    async def cancel_all(self) -> None:
        """Cancel every task still running and wait for them to end."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
