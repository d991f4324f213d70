"""``python -m services.state_aggregator``: the cluster-view builder, configured by ``KAIROS_*``."""

import asyncio

from services.common import run_main
from services.state_aggregator.config import AggregatorConfig
from services.state_aggregator.service import run
from shared.envconfig import main_config

if __name__ == "__main__":
    asyncio.run(run_main(run, main_config(AggregatorConfig, "state_aggregator")))
