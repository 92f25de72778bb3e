"""The onset model (bench/p0_onset.py) that chose the onset ramp: on the overload bench's own
plan, Floodgate's grant loop in front of the replicas' engine model, virtual clock."""

from __future__ import annotations

import pytest
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



def test_prefill_pacing_estimates_each_replica_from_its_admissions() -> None:
    """The estimate a processor could keep: each admitted prompt's tokens on its replica,
    draining at the rate; a lower class waits while P0 is in flight and the backlog it would
    join is over K (the least replica's with picking, the most loaded one's without)."""
    from floodgate.bench.p0_onset import Gate

    picking = Gate(Remedy("pick", prefill_k=512, prefill_rate=6000, per_replica=True), replicas=2)
    envoy = Gate(Remedy("max", prefill_k=512, prefill_rate=6000, pool_max=True), replicas=2)
    for g in (picking, envoy):
        g.admitted(1200, 0.0, replica=0)
    assert picking.open(1, 0.0, (1, 0, 0), 96, None)  # replica 1 has nothing to prefill
    assert not envoy.open(1, 0.0, (1, 0, 0), 96, None)  # Envoy may send it behind the 1,200
    assert envoy.open(1, 0.0, (0, 5, 5), 96, None)  # no P0 in flight: nothing to protect
    assert not envoy.open(1, 0.1, (1, 0, 0), 96, None)  # 600 left after 0.1 s at 6,000/s
    assert envoy.open(1, 0.12, (1, 0, 0), 96, None)  # 480 left
    assert envoy.open(0, 0.0, (1, 0, 0), 96, None)  # P0 is never held


def test_picking_with_prefill_pacing_beats_the_ramp_on_the_model() -> None:
    """With endpoint picking, routing to the least estimated prefill backlog and holding lower
    classes while it is over K takes the burst's P0 TTFT p99 well under the shipped ramp's at
    the goodput target; the picking alone, without the pacing, does not."""
    pool = PoolConfig()
    w = Workload(seed=2)
    ramp = run(w, 19.1, 96, Remedy("shipped", shipped=(pool.onset_ramp_burst, pool.onset_ramp_rate)), seed=2)
    paced = run(w, 19.1, 96, Remedy("pick", prefill_k=512, prefill_rate=6000, per_replica=True), seed=2)
    unpaced = run(w, 19.1, 96, Remedy("pick-inf", prefill_k=float("inf"), per_replica=True), seed=2)
    assert paced.p0_ttft_p99_burst_s < 0.8 * ramp.p0_ttft_p99_burst_s
    assert unpaced.p0_ttft_p99_burst_s > ramp.p0_ttft_p99_burst_s
    assert paced.goodput_burst_tok_s >= 0.95 * 1222


def test_a_mistyped_vegas_field_is_an_error_not_the_shipped_value(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m floodgate.bench.p0_onset --vegas '{"slo_targt": 0.5}'` (the docs cite --vegas
    runs) ran the shipped slo_target 0.75 without a word: model_copy(update=...) validates nothing."""
    from floodgate.bench.p0_onset import main

    for bad, said in (('{"slo_targt": 0.5}', "slo_targt: Extra inputs are not permitted"),
                      ('{"slo_target": "x"}', "slo_target: Input should be a valid number"),
                      ("not json", "--vegas: not JSON"), ("[1]", "a JSON object")):
        with pytest.raises(SystemExit) as exc:
            main(["--vegas", bad, "--seeds", "1", "--only", "nothing"])
        assert exc.value.code == 2
        assert said in capsys.readouterr().err
    assert main(["--vegas", '{"slo_target": 0.5}', "--seeds", "1", "--only", "nothing"]) in (0, None)
