"""``python -m kairos.services.profiler``: the same as ``kairos profile`` (options on the command line;
the command alone, kairos/cli/commands/profile.py, not the whole ``kairos`` CLI)."""

from kairos.cli.commands.profile import main

if __name__ == "__main__":
    main(prog_name="python -m kairos.services.profiler")
