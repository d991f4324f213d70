"""``python -m kairos.services.dispatcher``: one dispatcher replica, configured by ``KAIROS_*``."""

from kairos.runtime.service import serve
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import run
from kairos.runtime.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(DispatcherConfig, "dispatcher"), "dispatcher")
