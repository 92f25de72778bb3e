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

