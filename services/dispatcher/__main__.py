"""``python -m services.dispatcher``: one dispatcher replica, configured by ``KAIROS_*``."""

import asyncio

from services.common import run_main
from services.dispatcher.config import DispatcherConfig
from services.dispatcher.service import run
from shared.envconfig import main_config

if __name__ == "__main__":
    asyncio.run(run_main(run, main_config(DispatcherConfig, "dispatcher")))
