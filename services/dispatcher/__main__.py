"""``python -m services.dispatcher``: one dispatcher replica, configured by ``KAIROS_*``."""

from services.common import serve
from services.dispatcher.config import DispatcherConfig
from services.dispatcher.service import run
from shared.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(DispatcherConfig, "dispatcher"), "dispatcher")
