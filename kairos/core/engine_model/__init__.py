"""Continuous-batching engine model (one model, two clocks: docs/architecture.md).

A pure, clock-free state machine in the manner of vLLM's V1 scheduler, driven by a
:class:`~kairos.core.model.latency.LatencyModel`: :meth:`Engine.plan_step` says what the next step contains
and how long it takes, the caller advances its clock (simulator heap or ``asyncio.sleep``) and
calls :meth:`Engine.commit_step`. No I/O, no asyncio, no wall clock; the same inputs give the
same plans. See :mod:`kairos.core.engine_model.core` for the semantics and the vLLM behaviour emulated.
"""

from kairos.core.engine_model.core import Engine
from kairos.core.engine_model.truth import GroundTruth
from kairos.core.engine_model.types import EngineConfig, EngineError, EngineState, Role, StepPlan, StepResult

__all__ = ["Engine", "GroundTruth", "EngineConfig", "EngineError", "EngineState", "Role", "StepPlan", "StepResult"]
