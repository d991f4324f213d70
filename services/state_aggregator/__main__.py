"""``python -m services.state_aggregator``: the cluster-view builder, configured by ``KAIROS_*``."""

from services.common import serve
from services.state_aggregator.config import AggregatorConfig
from services.state_aggregator.service import run
from shared.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(AggregatorConfig, "state_aggregator"), "state_aggregator")
