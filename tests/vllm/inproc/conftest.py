"""In-process vLLM tier: a real vLLM-CPU engine (tiny model, float32, eager) built in the test
process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the tests reach the scheduler object.

These tests import vLLM: they run under the vLLM virtualenv (``make test-vllm``). Under ``.venv``
(no vLLM) this directory is not collected at all.

The truth the tests check against is vLLM's own: the ``SchedulerOutput`` of every step and the
``Request`` objects' ``num_computed_tokens`` (recorded by :class:`StepRecorder`), never the
plugin's publisher.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:  # .venv: nothing here can run
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: KV blocks of the test engine (128 tokens each on CPU): small on purpose, so a test can force a
#: preemption; every other test keeps its requests well below it.
NUM_BLOCKS = 12
MAX_MODEL_LEN = 1024
MAX_BATCHED_TOKENS = 512


def base_id(engine_req_id: str) -> str:
    """The id given to ``add_request`` (vLLM appends ``-<8 hex>`` to make it unique)."""
    return engine_req_id.rsplit("-", 1)[0]


@dataclass
class Sched:
    """One request's share of one step, from vLLM's SchedulerOutput."""

    tokens: int  #: num_scheduled_tokens[req]
    before: int  #: Request.num_computed_tokens before the step
    prompt: int  #: Request.num_prompt_tokens
    preemptions: int  #: Request.num_preemptions when scheduled


@dataclass
class StepRecorder:
    """Wraps the live scheduler's ``schedule`` and ``update_from_output`` to record vLLM's truth."""

    sched: Any
    steps: list[dict[str, Sched]] = field(default_factory=list)  #: non-empty steps, in order
    preempted: set[str] = field(default_factory=set)  #: base ids preempted at any step
    after: list[dict[str, Any]] = field(default_factory=list)  #: state after each non-empty step

    def install(self) -> "StepRecorder":
        sched = self.sched
        self._saved = {n: sched.__dict__.get(n) for n in ("schedule", "update_from_output")}
        orig_schedule, orig_update = sched.schedule, sched.update_from_output

        def schedule(*a, **k):
            out = orig_schedule(*a, **k)
            for rid in out.preempted_req_ids or ():
                self.preempted.add(base_id(rid))
            if out.total_num_scheduled_tokens:
                step = {}
                for rid, n in out.num_scheduled_tokens.items():
                    r = sched.requests[rid]
                    step[base_id(rid)] = Sched(n, r.num_computed_tokens - n, r.num_prompt_tokens, r.num_preemptions)
                self.steps.append(step)
            return out

        def update_from_output(scheduler_output, model_runner_output):
            res = orig_update(scheduler_output, model_runner_output)
            if scheduler_output.total_num_scheduled_tokens:
                dec = [r for r in sched.running if not r.is_prefill_chunk]  # vLLM's own flag
                pre = [r for r in sched.running if r.is_prefill_chunk] + list(sched.kv_holding_waiting) + list(sched.waiting)
                self.after.append({"B": len(dec), "K": sum(r.num_computed_tokens for r in dec),
                                   "waiting": [(base_id(r.request_id), r.num_prompt_tokens - r.num_computed_tokens)
                                               for r in pre]})
            return res

        sched.schedule, sched.update_from_output = schedule, update_from_output
        return self

    def uninstall(self) -> None:
        """Put back what was bound before :meth:`install` (normally: the class's methods)."""
        for name, saved in self._saved.items():
            if saved is None:
                self.sched.__dict__.pop(name, None)
            else:
                self.sched.__dict__[name] = saved

    def tokens_of(self, req: str) -> list[int]:
        return [s[req].tokens for s in self.steps if req in s]


@dataclass
class Engine:
    llm: Any
    sched: Any
    state_addr: str

    def add(self, req_id: str, prompt_ids: list[int], max_tokens: int, **extra: Any) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, extra_args=extra or None)
        self.llm.llm_engine.add_request(req_id, {"prompt_token_ids": prompt_ids}, sp)

    def step(self) -> list[Any]:
        return self.llm.llm_engine.step()

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        """Step until every request finished; returns base id → output token ids."""
        done: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.llm.llm_engine.has_unfinished_requests():
                return done
            for o in self.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def step_until(self, pred, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if pred():
                return
            self.step()
        raise AssertionError("condition not reached")

    def request(self, base: str) -> Any:
        return next(r for rid, r in self.sched.requests.items() if base_id(rid) == base)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kairos.engines.vllm.tiny_model import ensure_cached

    return str(ensure_cached())


@pytest.fixture(scope="module")
def engine(tiny_model):
    """One engine per module (start-up ~15 s, ~2 GB RSS) with the Kairos scheduler and a state socket."""
    from vllm import LLM

    tmp = tempfile.mkdtemp(prefix="kvi", dir="/tmp")  # ipc paths must stay short
    addr = f"ipc://{tmp}/state.sock"
    old = os.environ.get("KAIROS_ENGINE_STATE_ADDR")
    os.environ["KAIROS_ENGINE_STATE_ADDR"] = addr
    try:
        llm = LLM(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
                  max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=8, enable_prefix_caching=True,
                  num_gpu_blocks_override=NUM_BLOCKS, scheduler_cls="kairos.engines.vllm.plugin.scheduler.KairosScheduler",
                  seed=0)
    finally:
        if old is None:
            os.environ.pop("KAIROS_ENGINE_STATE_ADDR", None)
        else:
            os.environ["KAIROS_ENGINE_STATE_ADDR"] = old
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    yield Engine(llm, sched, addr)
    llm.llm_engine.engine_core.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def recorder(engine):
    """A fresh StepRecorder on the engine, with an idle engine and an empty prefix cache."""
    assert not engine.llm.llm_engine.has_unfinished_requests()
    engine.llm.reset_prefix_cache()
    rec = StepRecorder(engine.sched).install()
    yield rec
    rec.uninstall()
