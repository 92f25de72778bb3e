"""The pure engine model, driven by a fake clock."""

from __future__ import annotations

import statistics

import pytest
from floodgate.sim.engine import (
    Engine,
    EngineConfig,
    EngineNotAwake,
    PriorityNotEnabled,
    RequestTooLong,
    SeqState,
    SleepState,
    TokenEvent,
)

FAST = EngineConfig(
    max_num_seqs=8,
    block_size=16,
    num_kv_blocks=1000,
    max_num_batched_tokens=512,
    max_model_len=4096,
    prefill_per_token_s=0.0001,
    decode_base_s=0.010,
    decode_per_seq_s=0.001,
    wake_level1_s=1.0,
    wake_level2_s=5.0,
)


def run(engine: Engine, until: float | None = None, tick: float | None = None) -> list[TokenEvent]:
    """Advance until idle (or `until`), jumping to each event time or by fixed ticks."""
    events: list[TokenEvent] = []
    now = 0.0
    events += engine.advance(now)
    while True:
        nxt = engine.next_event_time()
        if nxt is None:
            break
        now = now + tick if tick is not None else max(now, nxt)
        if until is not None and now > until:
            break
        events += engine.advance(now)
    return events


def first_token_times(events: list[TokenEvent]) -> dict[str, float]:
    return {e.seq.request_id: e.time for e in events if e.index == 0}


def test_single_request_timing_matches_model() -> None:
    engine = Engine(FAST)
    engine.add_request("a", prompt_tokens=100, output_tokens=3, now=0.0)
    events = run(engine)
    assert [e.index for e in events] == [0, 1, 2]
    assert events[-1].finished and not events[0].finished
    # prefill step: base + 100 prompt tokens; then two decode steps of base + 1 seq.
    assert events[0].time == pytest.approx(0.010 + 100 * 0.0001)
    assert events[1].gap == pytest.approx(0.011)
    assert events[2].time == pytest.approx(0.020 + 0.022)
    assert engine.free_blocks == FAST.num_kv_blocks
    assert engine.stats.prompt_tokens == 100 and engine.stats.generation_tokens == 3
    assert engine.stats.finished == {"length": 1}


def test_batch_never_exceeds_max_num_seqs() -> None:
    engine = Engine(FAST)
    for i in range(20):
        engine.add_request(f"r{i}", 32, 10, 0.0)
    engine.advance(0.0)
    assert engine.num_running == 8 and engine.num_waiting == 12
    peak = 0
    now = 0.0
    while (nxt := engine.next_event_time()) is not None:
        now = nxt
        engine.advance(now)
        peak = max(peak, engine.num_running)
    assert peak == 8
    assert engine.stats.finished["length"] == 20


def test_ttft_climbs_with_queueing() -> None:
    engine = Engine(FAST)
    for i in range(24):
        engine.add_request(f"r{i:02d}", 64, 20, 0.0)
    ttft = first_token_times(run(engine))
    ordered = [ttft[f"r{i:02d}"] for i in range(24)]
    # FIFO: later arrivals never start earlier; each wave of 8 waits for the previous one.
    assert ordered == sorted(ordered)
    assert ordered[8] > ordered[7] + 19 * FAST.decode_base_s
    assert ordered[16] > ordered[8] + 19 * FAST.decode_base_s


def test_tpot_climbs_with_batch_size() -> None:
    def mean_gap(concurrency: int) -> float:
        engine = Engine(EngineConfig(max_num_seqs=256, decode_base_s=0.010,
                                     decode_per_seq_s=0.0005))
        for i in range(concurrency):
            engine.add_request(f"r{i}", 16, 50, 0.0)
        gaps = [e.gap for e in run(engine) if e.gap is not None]
        return statistics.mean(gaps)

    gaps = [mean_gap(n) for n in (1, 16, 64, 128)]
    assert gaps == sorted(gaps)
    assert gaps[0] == pytest.approx(0.0105)
    assert gaps[-1] == pytest.approx(0.010 + 128 * 0.0005)


def test_kv_budget_queues_requests_below_max_num_seqs() -> None:
    # 40 blocks of 16 tokens; each request needs ceil((200 + 1) / 16) = 13 blocks to start.
    engine = Engine(EngineConfig(max_num_seqs=64, num_kv_blocks=40, max_num_batched_tokens=4096))
    for i in range(6):
        engine.add_request(f"r{i}", 200, 4, 0.0)
    engine.advance(0.0)
    assert engine.num_running == 3 and engine.num_waiting == 3
    assert 0.0 < engine.kv_cache_usage <= 1.0
    run(engine)
    assert engine.stats.finished["length"] == 6
    assert engine.free_blocks == 40 and engine.kv_cache_usage == 0.0


def test_full_cache_preempts_newest_and_everything_still_finishes() -> None:
    # Prompts fit, but growth during decode does not: the newest sequence gets preempted.
    cfg = EngineConfig(max_num_seqs=64, block_size=16, num_kv_blocks=12,
                       max_num_batched_tokens=4096)
    engine = Engine(cfg)
    for i in range(4):
        engine.add_request(f"r{i}", 40, 60, 0.0)  # 3 blocks to start, 7 at the end
    events = run(engine)
    assert engine.stats.preemptions > 0
    assert engine.stats.finished["length"] == 4
    assert engine.free_blocks == cfg.num_kv_blocks
    counts: dict[str, int] = {}
    for e in events:
        counts[e.seq.request_id] = counts.get(e.seq.request_id, 0) + 1
    assert counts == {f"r{i}": 60 for i in range(4)}  # no token lost or duplicated
    assert engine.stats.prompt_tokens == 4 * 40  # recomputation is not new prompt


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    engine = Engine(EngineConfig(max_num_batched_tokens=512, prefill_per_token_s=0.0001,
                                 decode_base_s=0.01))
    engine.add_request("short", 16, 30, 0.0)
    run(engine, until=0.05)
    engine.add_request("long", 2000, 2, engine.next_event_time() or 0.0)
    events = run(engine)
    long_first = first_token_times(events)["long"]
    # 2000 tokens at <= 511 per step (one slot goes to the decoding sequence): 4 steps.
    prefill_steps = [e for e in events if e.seq.request_id == "short" and e.time < long_first]
    assert len(prefill_steps) >= 3
    assert all(e.gap is not None and e.gap < 0.07 for e in prefill_steps)


def test_results_do_not_depend_on_how_often_advance_is_called() -> None:
    def times(tick: float | None) -> list[tuple[str, int, float]]:
        engine = Engine(FAST)
        for i in range(12):
            engine.add_request(f"r{i}", 50 + i, 5 + i, 0.0)
        return [(e.seq.request_id, e.index, round(e.time, 9)) for e in run(engine, tick=tick)]

    assert times(None) == times(0.0037) == times(0.05)


def test_idle_engine_starts_at_the_arrival() -> None:
    engine = Engine(FAST)
    engine.advance(5.0)
    engine.add_request("a", 10, 1, 7.0)
    assert engine.next_event_time() == 7.0
    events = engine.advance(8.0)
    assert len(events) == 1 and events[0].time == pytest.approx(7.0 + 0.010 + 10 * 0.0001)


def test_fcfs_refuses_a_priority_like_vllm() -> None:
    engine = Engine(FAST)
    with pytest.raises(PriorityNotEnabled, match="Got priority -1 but Priority scheduling is not enabled"):
        engine.add_request("a", 10, 1, 0.0, priority=-1)
    engine.add_request("b", 10, 1, 0.0, priority=0)  # the default is accepted under fcfs
    assert engine.num_waiting == 1 and "a" not in engine.seqs
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def _queue_order(policy: str) -> list[str]:
    """Six 600-token prompts arrive at once into a budget of 512 tokens per step (one prompt at a
    time); a late low-value priority request joins while the first prompt is being prefilled."""
    engine = Engine(EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, scheduling_policy=policy))
    for i in range(6):
        engine.add_request(f"low{i}", 600, 2, 0.0)
    engine.advance(0.0)
    t = engine.next_event_time() or 0.0
    engine.advance(t)  # step 1 done (low0 512 of 600 tokens); step 2 starts: low0, low1 running
    engine.add_request("p0", 600, 2, t, priority=-1 if policy == "priority" else 0)
    events = run(engine)
    first = first_token_times(events)
    return sorted(first, key=lambda k: first[k])


def test_priority_policy_orders_the_waiting_queue_by_priority_then_arrival() -> None:
    # fcfs: the late request waits behind every prompt that arrived before it
    assert _queue_order("fcfs") == ["low0", "low1", "low2", "low3", "low4", "low5", "p0"]
    # priority: it goes ahead of every *waiting* one; the running prefills are not interrupted
    # (vLLM v1 never preempts a running request for a waiting one): low0's rest and low1's first
    # chunk were scheduled in the step that started as p0 arrived
    assert _queue_order("priority") == ["low0", "low1", "p0", "low2", "low3", "low4", "low5"]


def test_priority_policy_equal_priorities_is_fcfs() -> None:
    def order(policy: str, prio: int) -> list[tuple[str, int, float]]:
        engine = Engine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, scheduling_policy=policy))
        for i in range(10):
            engine.add_request(f"r{i}", 100 + 10 * i, 3 + i, 0.01 * i, priority=prio)
        return [(e.seq.request_id, e.index, round(e.time, 9)) for e in run(engine)]

    assert order("priority", 3) == order("priority", 0) == order("fcfs", 0)


def test_priority_policy_preempts_the_lowest_priority_running_request() -> None:
    # Prompts fit, growth does not (as in the fcfs preemption test above). Under fcfs the newest
    # admitted sequence is preempted; by priority the one with the largest (priority, arrival),
    # so the high-priority request admitted last is never preempted.
    def preempted(policy: str) -> dict[str, int]:
        cfg = EngineConfig(max_num_seqs=64, block_size=16, num_kv_blocks=12, max_num_batched_tokens=4096,
                           scheduling_policy=policy)
        engine = Engine(cfg)
        seqs = [engine.add_request(f"r{i}", 40, 60, 0.0, priority=1 if policy == "priority" else 0)
                for i in range(3)]
        seqs.append(engine.add_request("hi", 40, 60, 0.0))  # priority 0: the most important
        events = run(engine)
        assert engine.stats.finished["length"] == 4 and engine.free_blocks == cfg.num_kv_blocks
        counts: dict[str, int] = {}
        for e in events:
            counts[e.seq.request_id] = counts.get(e.seq.request_id, 0) + 1
        assert set(counts.values()) == {60}  # no token lost or duplicated
        return {s.request_id: s.num_preemptions for s in seqs}

    fcfs = preempted("fcfs")
    assert fcfs["hi"] > 0  # the newest admitted
    prio = preempted("priority")
    assert prio["hi"] == 0 and sum(prio.values()) > 0
    assert prio["r2"] >= prio["r0"]  # the latest arrival of the lowest priority goes first


def test_abort_frees_blocks_and_the_slot() -> None:
    engine = Engine(FAST)
    engine.add_request("a", 500, 100, 0.0)
    engine.add_request("b", 20, 100, 0.0)
    run(engine, until=0.2)
    assert engine.num_running == 2 and engine.free_blocks < FAST.num_kv_blocks
    seq = engine.abort("a", 0.2)
    assert seq is not None and seq.state is SeqState.ABORTED
    assert engine.num_running == 1
    engine.abort("b", 0.2)
    assert engine.free_blocks == FAST.num_kv_blocks
    assert engine.num_running == 0 and engine.num_waiting == 0
    run(engine)
    assert engine.free_blocks == FAST.num_kv_blocks
    assert engine.stats.finished == {"abort": 2}
    assert engine.abort("a", 1.0) is None  # idempotent


def test_aborting_a_waiting_request() -> None:
    engine = Engine(EngineConfig(max_num_seqs=1))
    engine.add_request("a", 10, 10, 0.0)
    engine.add_request("b", 10, 10, 0.0)
    engine.advance(0.0)
    assert engine.num_waiting == 1
    engine.abort("b", 0.0)
    assert engine.num_waiting == 0
    assert {e.seq.request_id for e in run(engine)} == {"a"}


def test_request_longer_than_context_is_refused() -> None:
    engine = Engine(EngineConfig(max_model_len=100))
    with pytest.raises(RequestTooLong):
        engine.add_request("a", 90, 20, 0.0)
    engine = Engine(EngineConfig(num_kv_blocks=4, block_size=16))
    with pytest.raises(RequestTooLong):
        engine.add_request("a", 60, 10, 0.0)


def test_sleep_wait_drains_then_sleeps_and_wakes_after_delay() -> None:
    engine = Engine(FAST)
    engine.add_request("a", 10, 5, 0.0)
    engine.advance(0.0)
    assert engine.sleep(1, "wait", 0.0) == []
    assert engine.sleep_state is SleepState.DRAINING and not engine.is_sleeping
    with pytest.raises(EngineNotAwake):
        engine.add_request("b", 10, 5, 0.0)
    events = run(engine)
    assert len(events) == 5 and events[-1].finished  # in-flight work completed
    assert engine.sleep_state is SleepState.ASLEEP and engine.sleep_level == 1
    assert engine.is_sleeping
    now = 10.0
    ready = engine.wake_up(now)
    assert ready == pytest.approx(now + FAST.wake_level1_s)
    assert engine.is_sleeping and engine.next_event_time() == ready
    engine.advance(ready - 0.01)
    assert engine.sleep_state is SleepState.WAKING
    engine.advance(ready)
    assert engine.sleep_state is SleepState.AWAKE and not engine.is_sleeping
    engine.add_request("c", 10, 1, ready)


def test_sleep_abort_drops_in_flight_and_level2_wakes_slower() -> None:
    engine = Engine(FAST)
    for i in range(12):
        engine.add_request(f"r{i}", 100, 50, 0.0)
    run(engine, until=0.1)
    aborted = engine.sleep(2, "abort", 0.1)
    assert len(aborted) == 12 and all(s.state is SeqState.ABORTED for s in aborted)
    assert engine.sleep_state is SleepState.ASLEEP and engine.sleep_level == 2
    assert engine.free_blocks == FAST.num_kv_blocks
    assert engine.advance(0.5) == []  # the step in flight emits nothing for aborted sequences
    assert engine.wake_up(1.0) == pytest.approx(1.0 + FAST.wake_level2_s)


def test_wake_up_while_draining_cancels_the_sleep() -> None:
    engine = Engine(FAST)
    engine.add_request("a", 10, 5, 0.0)
    engine.advance(0.0)
    engine.sleep(1, "wait", 0.0)
    assert engine.wake_up(0.001) == 0.001
    assert engine.sleep_state is SleepState.AWAKE
    assert len(run(engine)) == 5


def test_invalid_sleep_arguments() -> None:
    engine = Engine(FAST)
    with pytest.raises(ValueError):
        engine.sleep(3, "wait", 0.0)
    with pytest.raises(ValueError):
        engine.sleep(1, "keep", 0.0)


def test_time_scale() -> None:
    cfg = EngineConfig().scaled(0.1)
    assert cfg.decode_base_s == pytest.approx(0.002)
    assert cfg.wake_level2_s == pytest.approx(0.8)
    with pytest.raises(ValueError):
        EngineConfig().scaled(0)
