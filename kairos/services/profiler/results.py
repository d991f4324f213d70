"""What one profiling run collected, and how it fails.

:class:`ProfileRun` holds the node's step records (every one a fitting sample,
:func:`kairos.core.model.profiling.step_records`), the replay's counts and provenance;
:class:`ProfileRunError` says which of the profiler's requests the node refused, lost or never ran,
and carries the partial run. Filled by :class:`kairos.services.profiler.service.Profiler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kairos.contracts.wire import StepRecordEvent
from kairos.core.model.fitting import StepRecord
from kairos.core.model.profiling import step_records


class ProfileRunError(RuntimeError):
    """The node did not take the profiler's work (refused, silent or lost it): the message says which.
    ``partial`` holds what the run collected until then (its step records), if anything."""

    partial: "ProfileRun | None" = None


@dataclass
class ProfileRun:
    """What one profiling run collected."""

    events: list[StepRecordEvent] = field(default_factory=list)
    replay_counts: dict[str, int] = field(default_factory=dict)  #: :meth:`Profiler.replay`'s counts, if any
    extra: dict[str, Any] = field(default_factory=dict)  #: more provenance for the artifact's metadata (load average)
    started_unix_ms: float = 0.0
    finished_unix_ms: float = 0.0

    @property
    def records(self) -> list[StepRecord]:
        """The step records as fitting samples (:func:`kairos.core.model.profiling.step_records`)."""
        return step_records(self.events)
