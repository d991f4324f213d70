"""What one profiling run collected, and how it fails.

:class:`ProfileRun` holds the node's step records (every one a fitting sample,
:func:`kairos.core.model.profiling.step_records`), the replay's counts and provenance;
:class:`ProfileRunError` says which of the profiler's requests the node refused, lost or never ran,
and carries the partial run. Filled by :class:`kairos.services.profiler.service.Profiler`.
:func:`write_records` writes a run's raw step records (``--records``), :func:`load_average_since`
the host's load around it (the artifact's ``load_average``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kairos.contracts.wire import StepRecordEvent, encode
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


def write_records(path: str, events: list[StepRecordEvent]) -> None:
    """The raw step records as JSON lines (one :class:`~kairos.contracts.wire.StepRecordEvent` each,
    in arrival order) at ``path`` (its folder created). Raises OSError when it cannot be written."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.writelines(encode(e) + b"\n" for e in events)


def load_average_since(before: tuple[float, float, float]) -> dict:
    """The artifact's ``load_average`` record: the host's 1/5/15-minute load averages ``before``
    the run (``os.getloadavg()`` then) and now — step times on a shared CPU depend on them."""
    return {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()],
            "of": "1, 5, 15 min"}
