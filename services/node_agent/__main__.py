"""``python -m services.node_agent``: one node agent, configured by ``KAIROS_*`` env variables."""

from services.common import serve
from services.node_agent.agent import run
from services.node_agent.config import AgentConfig
from shared.envconfig import main_config

if __name__ == "__main__":
    serve(run, main_config(AgentConfig, "node_agent"), "node_agent")
