"""What every service main shares: SIGINT/SIGTERM → a stop event, then ``run(config, stop)``."""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Awaitable, Callable


async def run_main(run: Callable[..., Awaitable[Any]], config: Any) -> None:
    """Run a service until SIGINT/SIGTERM, then let it drain."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run(config, stop)
