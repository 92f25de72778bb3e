"""The onset model (bench/p0_onset.py) that chose the onset ramp: on the overload bench's own
plan, Floodgate's grant loop in front of the replicas' engine model, virtual clock."""

from __future__ import annotations

from floodgate.bench.overload import Workload
from floodgate.bench.p0_onset import Remedy, run
from floodgate.extproc.config import PoolConfig


def test_shipped_ramp_lowers_burst_p0_ttft_at_the_same_goodput() -> None:
    pool = PoolConfig()
    w = Workload(seed=1)
    base = run(w, 19.1, 96, Remedy(), seed=1)
    ramp = run(w, 19.1, 96, Remedy("shipped", shipped=(pool.onset_ramp_burst, pool.onset_ramp_rate)), seed=1)
    # without the ramp the worst burst P0s are the onset's (p99 over the whole burst well above
    # the p99 after its first 2 s); with it the onset no longer stands out
    assert base.p0_ttft_p99_burst_s > 1.1 * base.p0_ttft_p99_after2_s
    assert ramp.p0_ttft_p99_burst_s < 0.9 * base.p0_ttft_p99_burst_s
    assert ramp.p0_ttft_p99_burst_s < 1.05 * ramp.p0_ttft_p99_after2_s
    assert ramp.goodput_burst_tok_s >= 0.95 * base.goodput_burst_tok_s
    assert ramp.rejected_burst[0] == base.rejected_burst[0] == 0  # P0 is never paced away


def test_a_climbing_limit_lets_fewer_prompts_in_at_once_with_the_shipped_bucket() -> None:
    # The limit climbs +12 every 2 s through the burst (as Vegas's 6 lg steps did in the overload
    # bench): each step frees 12 permits at once; the ramp's bucket decides how many prompts land
    # in the engines' FIFO queues together, ahead of the next P0s. Deterministic (virtual clock).
    pool = PoolConfig()
    shipped = Remedy("shipped", shipped=(pool.onset_ramp_burst, pool.onset_ramp_rate))
    before = Remedy("bucket-8", shipped=(0.08, 0.1), ramp_min_burst=8.0)
    new, old = [], []
    for seed in (1, 2, 3, 4):
        w = Workload(seed=seed)
        start = w.windows()["burst"][0]
        steps = [(start + 1.0 + 2.0 * k, 72 + 12 * (k + 1)) for k in range(4)]
        new.append(run(w, 19.1, 72, shipped, seed=seed, limit_steps=steps))
        old.append(run(w, 19.1, 72, before, seed=seed, limit_steps=steps))
    mean = lambda rs: sum(r.p0_ttft_p99_burst_s for r in rs) / len(rs)  # noqa: E731
    assert mean(new) < 0.9 * mean(old)
    assert sum(r.goodput_burst_tok_s for r in new) >= 0.97 * sum(r.goodput_burst_tok_s for r in old)
    assert all(r.rejected_burst[0] == 0 for r in new)
