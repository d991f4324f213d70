"""The ``kairos`` command line (entry point ``kairos = kairos.cli.main:main``; also
``python -m kairos.cli.main``): the click group and its subcommands, one module per group in
:mod:`kairos.cli.commands`.

stdout carries results (JSON or tables), stderr carries messages; bad input exits with code 2.
"""

from __future__ import annotations

import click

from kairos.cli.commands.live import bench, drain, trace
from kairos.cli.commands.nats import nats_auth, nats_cluster
from kairos.cli.commands.offline import decide, sim
from kairos.cli.commands.plan import plan
from kairos.cli.commands.profile import profile
from kairos.cli.commands.stack import demo, up


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kairos")
def main() -> None:
    """Kairos: load-aware prefill deflection for P/D-disaggregated LLM serving."""


for _command in (decide, sim, plan, bench, up, nats_auth, nats_cluster, demo, profile, trace, drain):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
