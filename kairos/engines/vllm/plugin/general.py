"""Kairos's vLLM *general plugin*: keeps an idle vLLM-CPU engine idle.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API server,
engine core, worker: ``vllm/plugins/__init__.py`` ``load_general_plugins``, called from
``v1/engine/core.py`` and ``v1/worker/worker_base.py`` of 0.32.0) before the KV connector is
built. The entry point is declared in ``kairos/engines/vllm/plugin/plugins/kairos_vllm_plugins-0.32.0.dist-info``,
a metadata-only distribution that ``importlib.metadata`` finds because
:class:`kairos.engines.vllm.launch.VllmServer` puts ``kairos/engines/vllm/plugin/plugins`` on the engine's ``PYTHONPATH``
(:data:`PLUGIN_PATH`). Nothing is installed into the vLLM virtualenv.

What it changes, each only when its environment variable asks for it (``kairos up --engine vllm``
and ``kairos profile --vllm`` set both through :class:`kairos.engines.vllm.launch.VllmServer`; a GPU deployment
sets neither):

``KAIROS_NIXL_PROGRESS_DELAY_US=<µs>``
    NIXL's agent starts a UCX progress thread (``nixl._api.nixl_agent``: ``useProgThread`` from
    ``nixl_agent_config(enable_prog_thread=True)``, and ``pthrDelay = 0``); vLLM's NIXL worker
    (``distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py`` l. 631–641) passes only
    ``num_threads``. With a zero delay the thread polls with a zero timeout forever: each engine
    spins one core at ~100 % while idle (``bench/vllm_pd_rate.py`` measures it). With a delay it
    sleeps in ``poll()`` between rounds (1,000 µs: ≈ 3 % of a core idle).
``KAIROS_VLLM_MQ_BUSY_LOOP_S=<seconds>``
    vLLM's shared-memory message queue between the engine core and its worker
    (``distributed/device_communicators/shm_broadcast.py``, ``SpinCondition``) spins with
    ``sched_yield`` for ``busy_loop_s`` = 1 s after every read before it sleeps on a socket. Both
    sides read (the worker its next step, the engine core the step's output), so a busy engine
    keeps a second thread spinning on some core for the whole run, stealing it from the other
    engine's forward pass. ``0`` sleeps at once (one ZMQ wake-up per step, tens of µs); the
    writer's notifications are then made lossless (:func:`set_mq_busy_loop`).

``KAIROS_VLLM_KEEP_AFFINITY=1``
    vLLM 0.32's NIXL worker on a CPU platform "reserves the last core of each NUMA node for KV
    transfer" by calling ``os.sched_setaffinity(0, [last core])`` in its constructor
    (``nixl/base_worker.py`` ``NixlBaseConnectorWorker.__init__``, l. 700–714). The call runs on
    the worker's main thread, which is the thread that runs the forward pass, after vLLM bound it
    to ``VLLM_CPU_OMP_THREADS_BIND``: every engine's compute moves to the machine's last core.
    With two engines on two cores both ran on core 1 at half speed each, whatever their binding
    (measured: the prefill server bound to core 0 had its worker's main thread allowed only on 1).
    The patch restores the thread's affinity when the constructor returns.

All patches are idempotent (vLLM may load plugins several times per process).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

#: the directory holding the plugin's entry-point metadata; put it on the engine's PYTHONPATH
PLUGIN_PATH = Path(__file__).resolve().parent / "plugins"
ENV_NIXL_PROGRESS_DELAY_US = "KAIROS_NIXL_PROGRESS_DELAY_US"
ENV_MQ_BUSY_LOOP_S = "KAIROS_VLLM_MQ_BUSY_LOOP_S"
ENV_KEEP_AFFINITY = "KAIROS_VLLM_KEEP_AFFINITY"

log = logging.getLogger("kairos.engines.vllm.plugin.general")


def set_nixl_progress_delay(delay_us: int) -> bool:
    """Make NIXL's UCX progress thread wait up to ``delay_us`` µs for work between polls (NIXL: 0, a spin).

    ``nixl._api.nixl_agent.__init__`` hard-codes ``agent_config.pthrDelay = 0`` on the
    ``nixl._bindings.nixlAgentConfig`` it passes to ``nixl._bindings.nixlAgent``; this wraps that
    constructor in ``nixl._api``'s bindings module so the config carries ``delay_us`` instead. The
    thread stays (on TCP, UCX's reads need the *target* side to progress too, and an idle prefill
    engine calls into NIXL only when it steps), but it sleeps in ``poll()`` instead of spinning.
    Sets ``UCX_RCACHE_MAX_UNRELEASED=1024`` first unless set, as
    ``vllm.distributed.nixl_utils._maybe_set_ucx_rcache_limit`` would, since this imports NIXL
    before vLLM does. Returns False (and changes nothing) when NIXL is not installed.

    Raises:
        ValueError: ``delay_us`` is negative.
    """
    if delay_us < 0:
        raise ValueError(f"{ENV_NIXL_PROGRESS_DELAY_US} must be >= 0 µs, got {delay_us}")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as api
    except ImportError:
        return False
    binding = api.nixlBind
    original = getattr(binding, "_kairos_original_agent", binding.nixlAgent)

    def agent(name, config):
        config.pthrDelay = delay_us
        return original(name, config)

    binding._kairos_original_agent = original
    binding.nixlAgent = agent
    return True


def set_mq_busy_loop(seconds: float) -> None:
    """Make vLLM's ``SpinCondition`` readers spin ``seconds`` after a read (vLLM's default: 1 s), and
    keep every write's wake-up.

    With a short spin the reader sleeps in ``poll()`` on the writer's notification socket, and
    then vLLM 0.32's notification is lossy: the writer's PUB socket has ``SNDHWM`` 1, so a write's
    notification is dropped while an earlier one is still in flight, and the reader may just have
    consumed that earlier, stale one. The reader then sleeps until its re-check interval
    (``SHM_READER_RECHECK_INTERVAL_MS``, 5 s) although the data is there — seen as P/D decode legs
    that each took 5 s. The writer's high-water mark is therefore lifted (0: unbounded; a reader's
    SUB socket conflates, so nothing piles up there).

    Raises:
        ValueError: ``seconds`` is negative or not finite.
    """
    if not 0.0 <= seconds < float("inf"):
        raise ValueError(f"{ENV_MQ_BUSY_LOOP_S} must be a finite number of seconds >= 0, got {seconds!r}")
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast as sb

    cls = sb.SpinCondition
    original = getattr(cls, "_kairos_original_init", cls.__init__)

    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1) -> None:  # noqa: N807
        if is_reader:
            original(self, is_reader, context, notify_address, busy_loop_s=seconds)
            return
        # the writer's socket must have its high-water mark before it binds (libzmq applies HWM
        # options to connections made after they are set), so it is created here the same way
        # vLLM does (shm_broadcast.py SpinCondition.__init__, writer branch) with SNDHWM 0
        original(self, is_reader, context, notify_address="inproc://kairos-unused-" + str(id(self)),
                 busy_loop_s=busy_loop_s)
        self.local_notify_socket.close(linger=0)
        sock = context.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(notify_address)
        self.local_notify_socket = sock

    cls._kairos_original_init = original
    cls.__init__ = __init__


def keep_nixl_worker_affinity() -> bool:
    """Make ``NixlBaseConnectorWorker.__init__`` leave the calling thread's CPU affinity as it found
    it (module docstring, ``KAIROS_VLLM_KEEP_AFFINITY``). Returns False where vLLM has no NIXL worker."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker as cls
    except ImportError:
        return False
    original = getattr(cls, "_kairos_original_init", cls.__init__)

    def __init__(self, *args, **kwargs) -> None:  # noqa: N807
        cpus = os.sched_getaffinity(0)
        try:
            original(self, *args, **kwargs)
        finally:
            os.sched_setaffinity(0, cpus)

    cls._kairos_original_init = original
    cls.__init__ = __init__
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: apply what the environment asks for (module docstring).

    Raises:
        ValueError: ``KAIROS_VLLM_MQ_BUSY_LOOP_S`` is not a number of seconds ≥ 0.
    """
    raw = os.environ.get(ENV_NIXL_PROGRESS_DELAY_US)
    if raw:
        try:
            delay_us = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_NIXL_PROGRESS_DELAY_US} must be a whole number of µs, got {raw!r}") from None
        if set_nixl_progress_delay(delay_us):
            log.info("kairos.engines.vllm.plugin: NIXL progress thread polls every %d µs (%s)", delay_us, ENV_NIXL_PROGRESS_DELAY_US)
    if os.environ.get(ENV_KEEP_AFFINITY) == "1" and keep_nixl_worker_affinity():
        log.info("kairos.engines.vllm.plugin: the NIXL worker keeps the engine thread's CPU affinity (%s=1)", ENV_KEEP_AFFINITY)
    raw = os.environ.get(ENV_MQ_BUSY_LOOP_S)
    if raw is not None and raw != "":
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_MQ_BUSY_LOOP_S} must be a number of seconds, got {raw!r}") from None
        set_mq_busy_loop(seconds)
        log.info("kairos.engines.vllm.plugin: shared-memory queue busy loop %.3f s (%s)", seconds, ENV_MQ_BUSY_LOOP_S)


__all__ = ["register", "set_nixl_progress_delay", "set_mq_busy_loop", "keep_nixl_worker_affinity", "PLUGIN_PATH",
           "ENV_NIXL_PROGRESS_DELAY_US", "ENV_MQ_BUSY_LOOP_S", "ENV_KEEP_AFFINITY"]
