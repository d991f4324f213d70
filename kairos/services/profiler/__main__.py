"""``python -m kairos.services.profiler``: the same as ``kairos profile`` (options on the command line)."""

from kairos.cli.main import profile

if __name__ == "__main__":
    profile()
