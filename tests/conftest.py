"""Test-wide settings. The ``mutation`` Hypothesis profile (``make mutation`` passes
``--hypothesis-profile=mutation``) draws the same examples in every run and keeps no example
database, so a mutant is killed or not by the tests alone, never by the luck of a draw or by a
failing example that an earlier mutant left behind."""

from hypothesis import settings

settings.register_profile("mutation", derandomize=True, database=None)
