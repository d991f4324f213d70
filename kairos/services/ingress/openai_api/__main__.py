"""``python -m kairos.services.ingress.openai_api``: print the README's table of OpenAI parameters."""

from kairos.services.ingress.openai_api.params import parameter_table_markdown

if __name__ == "__main__":
    print(parameter_table_markdown(), end="")
