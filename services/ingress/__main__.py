"""``python -m services.ingress``: the OpenAI-compatible HTTP ingress, configured by ``KAIROS_*``."""

from services.common import serve
from services.ingress.config import IngressConfig
from services.ingress.service import run
from shared.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(IngressConfig, "ingress"), "ingress")
