"""``python -m services.ingress``: the OpenAI-compatible HTTP ingress, configured by ``KAIROS_*``."""

import asyncio

from services.common import run_main
from services.ingress.config import IngressConfig
from services.ingress.service import run
from shared.envconfig import main_config

if __name__ == "__main__":
    asyncio.run(run_main(run, main_config(IngressConfig, "ingress")))
