"""Prefix caches: the engine's block-hash cache (kairos/core/engine_model/prefix.py), its use by the engine
model, the view's prefix index (kairos/core/cluster/prefix_index.py) and the Mooncake trace's hashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kairos.core.engine_model import Engine

from kairos.core.engine_model import EngineConfig
from kairos.core.engine_model.prefix import PrefixCache
from kairos.core.model.latency import load_profile
from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.workload.workloads import BUNDLED_TRACES, MOONCAKE_BLOCK_TOKENS, TRACES_DIR, load_mooncake_jsonl

MODEL = load_profile()


def engine(role: str = "prefill", *, kv: int = 1_200_000, bt: int = 16, caching: bool = True) -> Engine:
    cfg = EngineConfig(role=role, max_num_seqs=64, max_num_batched_tokens=2048, kv_capacity_tokens=kv,
                       block_size=16, prefix_block_tokens=bt, prefix_caching=caching)
    return Engine(cfg, MODEL)


def run(e: Engine) -> list:
    plans = []
    while (plan := e.plan_step()) is not None:
        res = e.commit_step(plan)
        plans.append(plan)
        for rid in res.prefill_done:
            e.release(rid)
    return plans


# -- PrefixCache ----------------------------------------------------------------------------
def test_hit_is_the_leading_run_and_leaves_one_token_to_compute() -> None:
    c = PrefixCache(16)
    c.insert([1, 2, 3])
    assert c.hit_blocks([1, 2, 9, 3]) == 2  # a miss ends the prefix even if later hashes exist
    assert c.hit_blocks([9, 1]) == 0
    assert c.hit_tokens([1, 2, 3], 100) == 48
    assert c.hit_tokens([1, 2, 3], 48) == 32  # the whole prompt cached: the last block is recomputed
    assert c.hit_tokens([1, 2, 3], 33) == 32


def test_pinned_blocks_survive_eviction_and_free_ones_go_lru_tail_first() -> None:
    c = PrefixCache(10)
    held = c.insert([1, 2, 3])
    c.evict_to(0)
    assert c.hashes() == {1, 2, 3}  # pinned
    c.unpin(held)
    c.drain_events()
    c.evict_to(20)  # room for two blocks: the tail (3) goes first
    assert c.hashes() == {1, 2}
    assert c.drain_events() == ([], [3])
    c.pin([1])
    c.evict_to(0)
    assert c.hashes() == {1}


def test_events_are_net_changes() -> None:
    c = PrefixCache(10)
    c.unpin(c.insert([1, 2]))
    c.evict_to(0)  # stored and removed since the last drain: reported as removed only
    c.insert([3])
    assert c.drain_events() == ([3], [2, 1])
    c.insert([2])
    c.unpin([3])
    c.evict_to(0)
    assert c.drain_events() == ([2], [3])


# -- Engine ---------------------------------------------------------------------------------
def test_second_prompt_with_shared_prefix_computes_only_the_rest() -> None:
    e = engine()
    e.add_prefill("a", 100, [1, 2, 3, 4, 5, 6])
    first = run(e)
    assert first[0].prefill_chunks == (("a", 100, 0),)
    e.add_prefill("b", 90, [1, 2, 3, 7, 8])
    plan = e.plan_step()
    assert plan.prefill_chunks == (("b", 90 - 48, 48),)  # 3 shared blocks of 16 tokens
    assert e.cached_prefix_tokens("b") == 48


def test_caching_off_and_no_hashes_never_hit() -> None:
    for e, hashes in ((engine(caching=False), [1, 2]), (engine(), [])):
        e.add_prefill("a", 64, hashes)
        run(e)
        e.add_prefill("b", 64, hashes)
        assert e.plan_step().prefill_chunks == (("b", 64, 0),)


def test_deflected_prefill_on_a_decode_node_starts_after_its_hit() -> None:
    e = engine("decode")
    e.add_remote_decode("prev", 64, 2, [1, 2, 3, 4])
    e.admit()
    for rid in e.poll_allocated():
        e.kv_arrived(rid)  # the previous turn's KV arrived: its blocks are cached here
    run(e)
    e.add_deflected("next", 100, 3, [512], [1, 2, 3, 4, 5, 6])
    plan = e.plan_step()
    assert plan.deflected_chunk is not None
    assert plan.prefill_chunks == (("next", 100 - 64, 64),)


def test_remote_decode_reports_the_hit_its_transfer_can_skip() -> None:
    e = engine("decode")
    e.add_deflected("prev", 64, 1, [512], [1, 2, 3, 4])
    run(e)
    e.add_remote_decode("next", 80, 5, [1, 2, 9, 9, 9])
    e.admit()
    assert e.cached_prefix_tokens("next") == 32


def test_capacity_evicts_the_least_recently_used_prompt() -> None:
    e = engine(kv=160)  # 10 blocks of 16 tokens
    e.add_prefill("a", 80, [10, 11, 12, 13, 14])
    run(e)
    e.add_prefill("b", 80, [20, 21, 22, 23, 24])
    run(e)
    assert e.prefix_hit_tokens([10, 11, 12, 13, 14], 81) == 80
    e.add_prefill("c", 96, [30, 31, 32, 33, 34, 35])  # needs 6 blocks: a's (older) go, not b's
    run(e)
    assert e.prefix_hit_tokens([10, 11], 33) < 32
    assert e.prefix_hit_tokens([20, 21, 22, 23, 24], 81) > 0
    e.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8), st.integers(1, 4)), min_size=1, max_size=25))
def test_index_fed_by_events_equals_the_cache(ops: list[tuple[int, int, int]]) -> None:
    """Independent truth: the engine's own cache contents; the index only sees drained events."""
    e = engine(kv=320)
    index = PrefixIndex(16)
    for i, (conv, blocks, drain_every) in enumerate(ops):
        hashes = [conv * 100 + j for j in range(blocks)]  # conversations share prefixes
        e.add_prefill(f"r{i}", blocks * 16 + 1, hashes)
        run(e)
        if i % drain_every == 0:
            index.apply("p0", *e.drain_cache_events())
            assert index.node_hashes("p0") == e.cache.hashes()
    index.apply("p0", *e.drain_cache_events())
    assert index.node_hashes("p0") == e.cache.hashes()


# -- PrefixIndex ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["n0", "n1", "n2", "n3"]), st.sets(st.integers(0, 12), max_size=10)),
       st.lists(st.integers(0, 12), max_size=10), st.integers(1, 200))
def test_index_matches_a_per_node_scan(holdings: dict[str, set[int]], hashes: list[int], prompt: int) -> None:
    index = PrefixIndex(16)
    for node, hs in holdings.items():
        index.apply(node, hs, ())
    want = {}
    for node, hs in holdings.items():  # reference: walk each node's hashes one by one
        n = 0
        for h in hashes[:prompt // 16]:
            if h not in hs:
                break
            n += 1
        tokens = min(n * 16, (prompt - 1) // 16 * 16)
        if tokens:
            want[node] = tokens
    assert index.match_tokens(hashes, prompt) == want


@pytest.mark.parametrize("prompt, want", [
    # exactly 3 blocks, all cached on a: min(3·16, ⌊47/16⌋·16 = 32) — the last block is recomputed
    (48, {"a": 32, "b": 16}),
    (49, {"a": 48, "b": 16}),  # one token past the blocks: min(48, ⌊48/16⌋·16 = 48)
    (47, {"a": 32, "b": 16}),  # 2 full blocks fit (hashes[:47 // 16]): min(32, ⌊46/16⌋·16 = 32)
    (32, {"a": 16, "b": 16}),  # 2 blocks exactly: min(32, ⌊31/16⌋·16 = 16)
    (16, {}),  # one block: ⌊15/16⌋·16 = 0 tokens may come from cache — nobody is reported
    (1, {}),
    (0, {}),
])
def test_match_tokens_leaves_at_least_one_prompt_token_to_compute(prompt: int, want: dict[str, int]) -> None:
    index = PrefixIndex(16)
    index.apply("a", [1, 2, 3], ())
    index.apply("b", [1], ())
    assert index.match_tokens([1, 2, 3], prompt) == want


def test_index_removal_and_reset() -> None:
    index = PrefixIndex(16)
    index.apply("a", [1, 2], ())
    index.apply("b", [1], ())
    index.apply("a", (), [2])
    assert index.match_blocks([1, 2]) == {"a": 1, "b": 1}
    index.reset_node("a")
    assert index.match_blocks([1, 2]) == {"b": 1}
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_index_counts_the_blocks_holding_a_hash() -> None:
    """Issue 16: a hash cached in two blocks (vLLM keeps both copies when two requests computed the
    same prefix at once, one BlockStored / BlockRemoved per block) lost one copy and the node's
    match fell from 7 blocks to 2."""
    index = PrefixIndex(16)
    chain = list(range(100, 107))
    index.apply("d0", chain, ())
    index.apply("d0", chain, ())  # the second request's copies
    index.apply("d0", (), [102])  # one copy of block 2 evicted
    assert index.match_blocks(chain) == {"d0": 7}
    index.apply("d0", (), [102])  # the last copy
    assert index.match_blocks(chain) == {"d0": 2}
    index.apply("d0", [102], [102, 102])  # one stored, two removed in one batch: order does not matter
    assert index.match_blocks(chain) == {"d0": 2} and 102 not in index.node_hashes("d0")
    index.reset_node("d0", [100, 100, 101])  # a resync lists the cache: one copy per hash
    index.apply("d0", (), [100])
    assert index.match_blocks(chain) == {}


def test_a_block_evicted_and_cached_again_between_drains_is_not_stored_twice() -> None:
    """The index counts copies, so the emulated cache (one block per hash) must report a hash as
    stored only when it was not cached at the previous drain."""
    c = PrefixCache(10)
    c.unpin(c.insert([1, 2]))
    assert c.drain_events() == ([1, 2], [])
    c.evict_to(0)
    c.unpin(c.insert([1]))  # evicted and cached again: still cached, as at the last drain
    assert c.drain_events() == ([], [2])
    index = PrefixIndex(10)
    index.apply("p0", [1, 2], ())
    index.apply("p0", [], [2])
    c.evict_to(0)
    index.apply("p0", *c.drain_events())
    assert index.node_hashes("p0") == c.hashes() == set()


def test_mooncake_trace_carries_its_hash_ids() -> None:
    reqs = load_mooncake_jsonl(TRACES_DIR / BUNDLED_TRACES["mooncake"])
    first = min(reqs, key=lambda r: r.id)
    assert first.block_hashes[:3] == (0, 1, 2)
    assert len(first.block_hashes) == -(-first.prompt_tokens // MOONCAKE_BLOCK_TOKENS)
    seen: set[int] = set()
    reused = total = 0
    for r in sorted(reqs, key=lambda r: r.id):
        for h in r.block_hashes:
            reused += h in seen
            seen.add(h)
            total += 1
    assert 0.3 < reused / total < 0.45  # the "reuses 37 % of its 512-token blocks"


# -- hashes and the heartbeat feed -----------------------------------------------------------
def test_hash_chains_identify_prefixes() -> None:
    from kairos.core.cluster.prefix_index import request_block_hashes, text_block_hashes, token_block_hashes

    a = token_block_hashes(list(range(40)), 16)
    b = token_block_hashes(list(range(32)) + [7] * 8, 16)
    c = token_block_hashes([1] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash
    assert token_block_hashes(list(range(16)) + [99] * 16, 16)[0] == a[0]
    t = text_block_hashes("x" * 64 + "y" * 64, 16)  # 4 bytes per token: 64-byte blocks
    assert len(t) == 2 and t[0] == text_block_hashes("x" * 64 + "z" * 70, 16)[0] != t[1]
    assert request_block_hashes(None, "x" * 200, 0) == []
    assert request_block_hashes([1] * 32, "ignored", 16) == token_block_hashes([1] * 32, 16)
    assert all(0 <= h < 2 ** 63 for h in a + t)


def test_hash_values_are_the_chained_blake2b_digests() -> None:
    """Independent truth: hashlib and struct directly (a stable wire value: nodes and dispatchers
    on different hosts must agree on it)."""
    import hashlib
    import struct

    from kairos.core.cluster.prefix_index import chain_hashes, request_block_hashes, text_block_hashes, token_block_hashes

    d0 = hashlib.blake2b(b"abcd", digest_size=8).digest()
    d1 = hashlib.blake2b(d0 + b"efgh", digest_size=8).digest()  # the second block digests the first's hash
    want = [int.from_bytes(d0, "big") >> 1, int.from_bytes(d1, "big") >> 1]  # top bit dropped: 63 bits
    assert chain_hashes(b"abcdefghij", 4) == want  # "ij" is not a full block
    ids = [0, 2 ** 63, 2 ** 64 - 1, 7]  # the whole unsigned 64-bit range of token ids
    raw = struct.pack("=4Q", *ids)
    assert token_block_hashes(ids, 2) == chain_hashes(raw, 16) and len(chain_hashes(raw, 16)) == 2
    text = "é" * 40  # 80 UTF-8 bytes: one 64-byte block of 16 tokens
    assert text_block_hashes(text, 16) == chain_hashes(text.encode("utf-8"), 64) != []
    assert request_block_hashes(None, text, 16) == text_block_hashes(text, 16)  # no ids: hashed from the text
    assert request_block_hashes(None, None, 16) == [] and request_block_hashes(None, "", 16) == []
    assert request_block_hashes([5, 6], None, 1) == token_block_hashes([5, 6], 1) != []  # 1-token blocks work
    assert request_block_hashes([5, 6], None, -1) == []


def test_index_block_size_one_and_a_shared_hash_removed_by_one_node() -> None:
    index = PrefixIndex(1)  # the smallest block
    index.apply("a", [1, 2], ())
    index.apply("b", [1, 2], ())
    assert index.match_tokens([1, 2], 2) == {"a": 1, "b": 1}  # min(2·1, ⌊1/1⌋·1 = 1)
    index.apply("a", (), [1])  # b still holds 1
    assert index.match_blocks([1, 2]) == {"b": 2}
    assert index.match_blocks([9, 1]) == {}  # the first hash is held by nobody
    with pytest.raises(ValueError, match=r"^block_tokens must be an int >= 1, got 0$"):
        PrefixIndex(0)
    with pytest.raises(ValueError, match=r"got 1.0$"):
        PrefixIndex(1.0)  # type: ignore[arg-type]


def test_heartbeat_feed_resyncs_after_a_lost_heartbeat() -> None:
    index = PrefixIndex(16)
    index.on_heartbeat("n", 1, 16, [1], [], full=False)  # no full state yet: ignored
    assert index.node_hashes("n") == frozenset()
    index.on_heartbeat("n", 2, 16, [1, 2], [], full=True)
    index.on_heartbeat("n", 3, 16, [3], [1], full=False)
    assert index.node_hashes("n") == {2, 3}
    index.on_heartbeat("n", 4, 16, [6], [], full=False)  # consecutive deltas keep applying
    assert index.node_hashes("n") == {2, 3, 6}
    index.on_heartbeat("n", 6, 16, [4], [], full=False)  # seq 5 was lost: forget until the next full
    assert index.node_hashes("n") == frozenset()
    index.on_heartbeat("n", 7, 16, [5], [], full=False)
    assert index.node_hashes("n") == frozenset()
    index.on_heartbeat("n", 8, 16, [2, 3, 4, 5], [], full=True)
    assert index.node_hashes("n") == {2, 3, 4, 5}
    index.on_heartbeat("n", 9, 32, [9], [], full=True)  # another block size never matches
    assert index.node_hashes("n") == frozenset()


def test_emulated_backend_reports_what_its_engine_caches() -> None:
    from kairos.engines.emulated import EmulatedBackend

    from kairos.contracts.wire import InferenceRequest

    def req(rid: str, prompt: int) -> InferenceRequest:
        return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=1, created_unix_ms=0.0,
                                deadline_unix_ms=1e15)

    be = EmulatedBackend("prefill", MODEL)
    be.note_block_hashes("a", [11, 12, 13], 16)
    be.add_prefill(req("a", 60))
    be.note_block_hashes("b", [21, 22], 512)  # another granularity: not used
    be.add_prefill(req("b", 40))
    run(be.engine)
    assert be.cache_events(full=False) == (16, [11, 12, 13], [], False)
    assert be.cache_events(full=False) == (16, [], [], False)
    tokens, stored, removed, full = be.cache_events(full=True)
    assert (tokens, sorted(stored), removed, full) == (16, [11, 12, 13], [], True)


def test_a_full_cache_sync_fits_one_nats_message_and_keeps_the_recent_chains() -> None:
    """A decode node with more cached blocks than one heartbeat can carry (1 MiB max_payload):
    the full sync carries the most recently used ones — the last request's chain whole — the
    encoded heartbeat stays under the limit, and a delta too large for one heartbeat becomes such
    a full sync."""
    from kairos.engines.emulated import EmulatedBackend

    from kairos.contracts.wire import CACHE_SYNC_MAX_HASHES, NodeState, encode

    be = EmulatedBackend("decode", MODEL)
    cache = be.engine.cache
    assert cache is not None
    n_chains, per_chain = 700, 100  # 70,000 blocks: 1.12 M tokens in 16-token blocks
    base = 2 ** 62  # hashes as large as real ones (64-bit)
    for c in range(n_chains):
        chain = [base + c * per_chain + i for i in range(per_chain)]
        cache.unpin(cache.insert(chain))
    last = [base + (n_chains - 1) * per_chain + i for i in range(per_chain)]
    tokens, stored, removed, full = be.cache_events(full=False)  # 70,000 new blocks: too many for a delta
    assert full and removed == [] and len(stored) == CACHE_SYNC_MAX_HASHES < len(cache)
    assert set(last) <= set(stored)  # the most recent chain is whole
    state = NodeState(node="decode-0", role="decode", seq=1, sent_unix_ms=0.0, period_ms=100.0, batch_size=0,
                      kv_tokens=0, cache_block_tokens=tokens, cache_stored=stored, cache_removed=removed,
                      cache_full=full)
    assert len(encode(state)) < 1024 * 1024
    index = PrefixIndex(16)
    index.on_heartbeat("decode-0", 1, tokens, stored, removed, full)
    assert index.match_blocks(last) == {"decode-0": per_chain}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["prefill", "deflect", "remote"]), st.integers(0, 3), st.integers(1, 9),
                          st.booleans(), st.integers(0, 3)), min_size=1, max_size=30))
def test_pins_and_capacity_stay_consistent_through_any_lifecycle(ops) -> None:
    """Random adds (shared prefixes), partial runs, KV arrivals and aborts on a small node: pin
    counts always equal the live requests' pins and evictable blocks fit in the free capacity."""
    for role in ("prefill", "decode"):
        e = engine(role, kv=480)
        live: list[str] = []
        for i, (kind, conv, blocks, abort, steps) in enumerate(ops):
            rid, hashes = f"r{i}", [conv * 100 + j for j in range(blocks)]
            if role == "prefill":
                e.add_prefill(rid, blocks * 16 + 3, hashes)
            elif kind == "deflect":
                e.add_deflected(rid, blocks * 16 + 3, 2, [256], hashes)
            else:
                e.add_remote_decode(rid, blocks * 16 + 3, 2, hashes)
            live.append(rid)
            e.admit()
            for a in e.poll_allocated():
                e.kv_arrived(a)
            for _ in range(steps):
                plan = e.plan_step()
                if plan is None:
                    break
                for done in e.commit_step(plan).prefill_done:
                    e.release(done)
            if abort and live:
                e.abort(live.pop(0))
            e.check_invariants()
        run(e)
        e.check_invariants()
