"""KairosScheduler against the real vLLM Scheduler, in process (contract A/B; docs/vllm.md).

Truth = vLLM's own SchedulerOutput / Request.num_computed_tokens (conftest.StepRecorder).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import statistics
import types

import pytest

from tests.vllm.inproc.conftest import MAX_BATCHED_TOKENS, StepRecorder

pytestmark = pytest.mark.vllm


def ids(seed: int, n: int) -> list[int]:
    """A prompt of n token ids in [7, 1006], distinct per seed (no accidental prefix hits)."""
    return [(seed * 7919 + 31 * k) % 1000 + 7 for k in range(n)]


def boundaries(schedule: list[int], prompt: int) -> set[int]:
    """Cumulative boundaries of a schedule, the last entry repeating, up to the prompt end."""
    out, total = set(), 0
    for p in itertools.chain(schedule, itertools.repeat(schedule[-1])):
        total += p
        if total >= prompt:
            return out | {prompt}
        out.add(total)


def assert_follows_schedule(rec: StepRecorder, req: str, schedule: list[int]) -> list[tuple[int, int]]:
    """Every prefill step of ``req`` ends on a schedule boundary (or the prompt end) and starts
    past the previous one: no chunk crosses or stops short of a boundary. Returns (before, tokens)."""
    chunks = [(s[req].before, s[req].tokens) for s in rec.steps if req in s and s[req].before < s[req].prompt]
    assert chunks, f"{req} was never prefilled"
    prompt = next(s[req].prompt for s in rec.steps if req in s)
    ends = boundaries(schedule, prompt)
    for before, n in chunks:
        end = before + n
        assert end in ends, f"{req}: chunk {before}->{end} does not end on a boundary of {schedule}"
        assert not any(before < b < end for b in ends), f"{req}: chunk {before}->{end} crosses a boundary"
    return chunks


def test_deflected_chunks_equal_schedule_while_another_request_decodes(engine, recorder):
    engine.add("dec", ids(1, 100), max_tokens=40)
    engine.step_until(lambda: engine.request("dec").num_output_tokens >= 2)
    schedule = [32, 100, 64]
    engine.add("defl", ids(2, 300), max_tokens=3, kairos_rid="K-defl", kairos_prefill_chunks=schedule)
    engine.run()

    # 300 = 32 + 100 + 64 + 64 + 40: the last entry repeats, the remainder ends the prompt
    assert [n for _, n in assert_follows_schedule(recorder, "defl", schedule)] == [32, 100, 64, 64, 40]
    prefill_steps = [s for s in recorder.steps if "defl" in s and s["defl"].before < 300]
    assert all(s["dec"].tokens == 1 for s in prefill_steps), "the decoding request must keep decoding"


def test_invalid_schedule_is_ignored_not_fatal(engine, recorder):
    engine.add("bad", ids(12, 200), max_tokens=2, kairos_rid="K-bad", kairos_prefill_chunks=[64, 0])
    done = engine.run()
    assert len(done["bad"]) == 2
    assert recorder.tokens_of("bad") == [200, 1], "an invalid schedule must leave the request uncapped"


def test_request_without_schedule_is_unchanged(engine, recorder):
    """Same workload on KairosScheduler and on the stock vLLM Scheduler (same engine, the stock
    methods bound over every override): identical tokens per step, including a long prefill
    chunked by vLLM's budget (700 > 512) beside decodes."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kairos.engines.vllm.plugin.scheduler import KairosSchedulerMixin

    sched = engine.sched

    def workload(seed: int) -> list[dict[str, int]]:
        rec = StepRecorder(sched).install()
        try:
            engine.add("dec", ids(seed, 60), max_tokens=12)
            engine.add("long", ids(seed + 1, 700), max_tokens=4)
            engine.add("short", ids(seed + 2, 90), max_tokens=6)
            engine.run()
        finally:
            rec.uninstall()
        return [{k: v.tokens for k, v in s.items()} for s in rec.steps]

    recorder.uninstall()
    kairos = workload(10)
    overrides = [n for n in vars(KairosSchedulerMixin) if callable(getattr(Scheduler, n, None)) and n != "__init__"]
    assert "_reserve_prefill_lookahead" in overrides and "schedule" in overrides
    for name in overrides:
        setattr(sched, name, types.MethodType(getattr(Scheduler, name), sched))
    try:
        stock = workload(20)  # other prompts of the same lengths: no prefix-cache hits
    finally:
        for name in overrides:
            delattr(sched, name)
        recorder.install()
    assert kairos == stock
    assert any(0 < s.get("long", 0) < 700 for s in kairos), "vLLM's budget must have chunked the long prompt"


def test_prefix_hit_and_preemption_keep_the_cursor(engine, recorder):
    sched = engine.sched
    # (a) prefix-cache hit: 256 tokens (2 full blocks) of "hit" are cached by "warm"
    shared = ids(3, 256)
    engine.add("warm", shared + ids(4, 44), max_tokens=1)
    engine.run()
    schedule = [100]
    engine.add("hit", shared + ids(5, 144), max_tokens=2, kairos_prefill_chunks=schedule)
    engine.run()
    chunks = assert_follows_schedule(recorder, "hit", schedule)
    assert chunks[0][0] == 256, "vLLM should have admitted 'hit' with its 256 cached tokens"
    assert [n for _, n in chunks] == [44, 100]  # 256 -> 300 (boundary), 300 -> 400

    # (b) preemption. 11 usable blocks of 128 tokens. "big" (760-token prompt, 6 blocks) decodes; vLLM
    # admits "defl" (600 tokens) because its whole prompt fits the 5 free blocks. "big" soon takes a
    # 7th block, so when "defl" (prefilling 5, 9, 9, … tokens per step) needs its 5th block at 512
    # tokens, allocation fails and vLLM preempts it (the newest running request). It is re-admitted
    # after "big" finishes, with its cached full blocks (512 tokens) as a prefix hit: its next chunk
    # must end on the schedule's next boundary, 518 = 5 + 57·9.
    recorder.steps.clear()
    engine.add("big", ids(6, 760), max_tokens=100)
    engine.step_until(lambda: engine.request("big").num_output_tokens >= 1)
    schedule = [5, 9]
    engine.add("defl", ids(7, 600), max_tokens=2, kairos_prefill_chunks=schedule)
    engine.run()
    assert "defl" in recorder.preempted, "the KV cache was expected to force a preemption of 'defl'"
    chunks = assert_follows_schedule(recorder, "defl", schedule)
    resumed = [(s["defl"].before, s["defl"].tokens) for s in recorder.steps
               if "defl" in s and s["defl"].preemptions > 0 and s["defl"].before < 600]
    assert resumed, "defl should have been prefilled again after its preemption"
    assert resumed[0][0] % 128 == 0 and resumed[0][0] > 0, "re-admission should hit its cached blocks"
    assert sum(n for _, n in resumed) == 600 - resumed[0][0]
    first = resumed[0][0]
    assert resumed[0][1] == min(b for b in boundaries(schedule, 600) if b > first) - first
    assert len(chunks) > len(resumed)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() > 0


def test_state_stream_matches_the_scheduler(engine, recorder):
    from kairos.engines.vllm.subscriber import EngineStateSubscriber

    async def scenario():
        async with EngineStateSubscriber(engine.state_addr) as sub:
            await sub.recv(timeout_s=10)  # subscribed (the idle re-send reaches us)
            first_step = engine.sched.kairos_steps
            engine.add("d1", ids(8, 120), max_tokens=30, kairos_rid="K-d1")
            engine.add("d2", ids(9, 200), max_tokens=25)
            engine.step_until(lambda: engine.request("d2").num_output_tokens >= 1)
            engine.add("defl", ids(10, 260), max_tokens=4, kairos_rid="K-defl", kairos_prefill_chunks=[64, 96])
            engine.add("late", ids(11, 180), max_tokens=3)
            engine.run()
            n_steps = engine.sched.kairos_steps - first_step
            snaps = []
            while sum(s.step_record is not None and s.step > first_step for s in snaps) < n_steps:
                snaps.append(await sub.recv(timeout_s=10))
            return snaps, sub.dropped

    snaps, dropped = asyncio.run(scenario())
    assert dropped == 0
    after = [s for s in snaps if s.step_record is not None]
    assert len(after) == len(recorder.steps) == len(recorder.after)
    names = {"K-d1": "d1", "K-defl": "defl"}
    for snap, truth, step in zip(after, recorder.after, recorder.steps):
        rec = snap.step_record
        assert (snap.batch_size, snap.kv_tokens) == (truth["B"], truth["K"])
        assert [(names.get(w.request_id, w.request_id.rsplit("-", 1)[0]), w.remaining_prefill_tokens)
                for w in snap.waiting] == truth["waiting"]
        dec = [s for s in step.values() if s.before >= s.prompt]
        assert rec.decode_count == len(dec) and rec.kv_tokens == sum(s.before for s in dec)
        assert rec.prefill_tokens == sum(min(s.tokens, s.prompt - s.before) for s in step.values() if s.before < s.prompt)
        want = ([("K-defl", step["defl"].tokens, step["defl"].before)] if "defl" in step and step["defl"].before < 260
                else [])
        assert [(c.request_id, c.tokens, c.computed_tokens) for c in rec.chunks] == want
        # every other prefilling request, with the context its chunk attends over (later chunks too)
        pre = sorted((names.get(c.request_id, c.request_id.rsplit("-", 1)[0]), c.tokens, c.computed_tokens)
                     for c in rec.prefills)
        assert pre == sorted((n, min(s.tokens, s.prompt - s.before), s.before) for n, s in step.items()
                             if s.before < s.prompt and n != "defl")
        assert rec.wall_ms > 0
    seen: set[str] = set()
    for snap, step in zip(after, recorder.steps):  # the step in which each request was first scheduled
        got = {names.get(r, r.rsplit("-", 1)[0]) for r in snap.step_record.first_scheduled}
        assert got == set(step) - seen
        seen |= set(step)
    assert seen == {"d1", "d2", "defl", "late"}
    chunks = [c for s in after for c in s.step_record.chunks]
    assert [(c.chunk_index, c.tokens, c.computed_tokens) for c in chunks] == [(0, 64, 0), (1, 96, 64), (2, 96, 160),
                                                                             (3, 4, 256)]
    assert any(s.batch_size >= 2 for s in after) and any(s.waiting for s in after)
    walls = sorted(s.step_record.wall_ms for s in after)
    print(f"\nstep wall_ms over {len(walls)} steps: median {statistics.median(walls):.2f}, max {walls[-1]:.2f}")


def test_version_guard_fails_loudly(monkeypatch):
    import vllm
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kairos.engines.vllm.plugin import VLLM_VERSION
    from kairos.engines.vllm.plugin import scheduler as ks

    assert vllm.__version__.split("+")[0] == VLLM_VERSION, "the vLLM venv must have the pinned vLLM"
    ks.check_vllm_compat(vllm.__version__, Scheduler)
    ks.check_vllm_compat(vllm.__version__, AsyncScheduler)
    for cls in (ks.KairosScheduler, ks.KairosAsyncScheduler):  # the mixin's overrides win in both
        assert cls._reserve_prefill_lookahead is ks.KairosSchedulerMixin._reserve_prefill_lookahead

    with pytest.raises(ks.VllmCompatError, match=r"found vLLM 0\.99\.0"):
        ks.check_vllm_compat("0.99.0", Scheduler)
    ks.check_vllm_compat("0.99.0", Scheduler, allow_unpinned=True)  # only the version differs

    class Changed(Scheduler):
        def _reserve_prefill_lookahead(self, request, num_new_tokens):  # a parameter disappeared
            return num_new_tokens

    with pytest.raises(ks.VllmCompatError, match=rf"vLLM {VLLM_VERSION}: Changed\._reserve_prefill_lookahead has parameters"):
        ks.check_vllm_compat(VLLM_VERSION, Changed)

    # the method vanishes from the installed vLLM: importing the plugin fails, naming the version
    monkeypatch.delattr(Scheduler, "_reserve_prefill_lookahead")
    with pytest.raises(RuntimeError, match=rf"vLLM {VLLM_VERSION}: Scheduler\._reserve_prefill_lookahead is missing") as exc:
        importlib.reload(ks)
    assert type(exc.value).__name__ == "VllmCompatError"  # the reloaded module's class
    monkeypatch.undo()
    importlib.reload(ks)


def test_settings_the_plugin_cannot_serve_refuse_to_start(engine):
    """Issue 16: with chunked prefill off the plugin still chunked; with async scheduling on,
    KairosScheduler started and then decoded only every other step. Each is refused at construction,
    naming the setting. The scheduler is built with the running engine's own arguments, so only the
    changed setting differs from a start that works."""
    import copy

    from kairos.engines.vllm.plugin import scheduler as ks

    sched = engine.sched
    args = (sched.kv_cache_config, sched.structured_output_manager, sched.block_size)

    def config(**changes):
        cfg = copy.copy(sched.vllm_config)
        cfg.scheduler_config = copy.copy(sched.vllm_config.scheduler_config)
        for k, v in changes.items():
            setattr(cfg.scheduler_config, k, v)
        return cfg

    assert sched.scheduler_config.enable_chunked_prefill and not sched.scheduler_config.async_scheduling
    with pytest.raises(ks.KairosConfigError, match=r"enable_chunked_prefill is off.*--enable-chunked-prefill"):
        ks.KairosScheduler(config(enable_chunked_prefill=False), *args)
    with pytest.raises(ks.KairosConfigError, match=r"KairosScheduler cannot run with async_scheduling on.*"
                                                   r"KairosAsyncScheduler"):
        ks.KairosScheduler(config(async_scheduling=True), *args)
    with pytest.raises(ks.KairosConfigError, match=r"KairosAsyncScheduler needs async_scheduling on"):
        ks.KairosAsyncScheduler(config(), *args)
    ks.check_scheduler_config(ks.KairosAsyncScheduler, config(async_scheduling=True).scheduler_config)  # its case
    ks.KairosScheduler(config(), *args).shutdown()  # the engine's own settings construct
