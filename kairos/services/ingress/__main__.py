"""``python -m kairos.services.ingress``: the OpenAI-compatible HTTP ingress, configured by ``KAIROS_*``."""

from kairos.runtime.service import serve
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import run
from kairos.runtime.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(IngressConfig, "ingress"), "ingress")
