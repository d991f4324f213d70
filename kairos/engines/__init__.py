"""Engine backends of the node agent: one folder (or module) per engine kind, and their registry.

* :mod:`kairos.engines.base` — the contract (:class:`~kairos.engines.base.EngineBackend`,
  :class:`~kairos.engines.base.EngineEvents`, :class:`~kairos.engines.base.StepOutput`);
* :mod:`kairos.engines.emulated` — the engine model driven in real time (the sample backend);
* :mod:`kairos.engines.vllm` — a vLLM server beside the agent (backend, HTTP client, API mapping,
  launcher) and ``vllm/plugin``, the scheduler plugin that runs *inside* vLLM.

:data:`BACKENDS` maps each ``KAIROS_BACKEND`` name to the class's import path, imported only when
asked for: this package is imported inside vLLM processes on the way to the plugin, so it imports
nothing but the standard library (tests/unit/test_layering.py checks it). Adding a backend is one
package and one entry here; kairos/engines/README.md says what it must do.
"""

from __future__ import annotations

import importlib
from typing import Any

#: backend name (``AgentConfig.backend``, ``KAIROS_BACKEND``) -> ``"module:Class"`` of its EngineBackend
BACKENDS: dict[str, str] = {
    "emulated": "kairos.engines.emulated:EmulatedBackend",
    "vllm": "kairos.engines.vllm.backend:VllmBackend",
}


def backend_class(name: str) -> Any:
    """The :class:`~kairos.engines.base.EngineBackend` subclass registered as ``name`` (imported now).

    Raises:
        ValueError: no backend has that name (the message lists the known ones).
    """
    try:
        path = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown engine backend {name!r} (known: {', '.join(BACKENDS)})") from None
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(cfg: Any, model: Any, truth: Any = None) -> Any:
    """The backend ``cfg.backend`` names, built from an
    :class:`~kairos.services.node_agent.config.AgentConfig` (``EngineBackend.from_config``). ``model``:
    the node's latency profile; ``truth``: the emulated engine's real step times (a real engine has
    its own).

    Raises:
        ValueError: an unknown backend name.
        ConfigError: the backend's settings cannot be read (the vLLM server's key file).
    """
    return backend_class(cfg.backend).from_config(cfg, model, truth)
