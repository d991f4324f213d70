"""``python -m kairos.services.node_agent``: one node agent, configured by ``KAIROS_*`` env variables."""

from kairos.runtime.service import serve
from kairos.services.node_agent.agent import run
from kairos.services.node_agent.config import AgentConfig
from kairos.runtime.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(AgentConfig, "node_agent"), "node_agent")
