"""``python -m kairos.services.state_aggregator``: the cluster-view builder, configured by ``KAIROS_*``."""

from kairos.runtime.service import serve
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import run
from kairos.runtime.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(AggregatorConfig, "state_aggregator"), "state_aggregator")
