"""Early drop's trade-off, measured on fake-clock replays: `python -m tests.policy_tradeoff`.

A class's `early_drop_min_chance` says how sure the grant loop must be to reach a request in
time before it may wait. Low: few requests are turned away that the grant loop would have
served in time (the rule's promise, `wrong_drops_at_current_rate`), but more wait their whole
timeout and then get 429 (slow rejections). High: the reverse. For each value, over the
property test's random histories and over the overload bench's burst (tests/test_policy_replay.py):
early drops, wrong drops, queue timeouts as a share of all rejections, requests served in time.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from floodgate.extproc.config import PoolConfig

from tests.policy_replay import Outcome, replay, wrong_drops_at_current_rate
from tests.test_policy_replay import bench_burst, p2_outcomes, random_history


def served(o: Outcome, i: int) -> bool:
    """Was request `i` of the replay served in time (at once, or granted before its deadline)?"""
    return i in o.granted_at and (o.decisions[i] == "immediate" or o.granted_at[i] <= o.deadline[i])


def measure(chance: float, seeds: range, burst_seeds: range) -> dict[str, Counter[str]]:
    # every class reads the rates optimistically at this chance (no reject target: the curve is
    # of the chance alone)
    classes = {k: c.model_copy(update={"early_drop_min_chance": chance, "slo_reject_s": 0.0})
               for k, c in PoolConfig().classes.items()}
    out: dict[str, Counter[str]] = {"random": Counter(), "burst": Counter()}
    runs = [("random", *random_history(s)) for s in seeds] + [("burst", 107, bench_burst(s)) for s in burst_seeds]
    for kind, limit, history in runs:
        c = out[kind]
        o = replay(limit, classes, history)
        c["drops"] += len(o.early_drops())
        c["wrong"] += len(wrong_drops_at_current_rate(o, classes, history))
        for i, a in enumerate(history):
            d = o.decisions[i]
            in_time = served(o, i)
            c["served"] += in_time
            c["timeouts"] += d == "queued" and not in_time
            if a.cls == 2:
                c["p2_served"] += in_time
                c["p2_timeouts"] += d == "queued" and not in_time
                c["p2_drops"] += d == "early_drop"
    return out


def reject_target(seeds: range, bench_seeds: range) -> None:
    """P2 with and without its reject target (`slo_reject_s`), the other classes as shipped:
    per class early drops and wrong drops over the random histories, and P2's queue timeouts,
    early drops and requests served in time over the bench's whole plan (burst and sparse
    phase, limits 96 and 107)."""
    shipped = PoolConfig().classes
    variants = {"P2 waits at 0.5 (no reject target)":
                {**shipped, 2: shipped[2].model_copy(update={"slo_reject_s": 0.0, "early_drop_min_chance": 0.5})},
                "shipped: P2 `slo_reject_s` 0.01": shipped}
    print("| P2 | random: wrong drops P0 / P1 / P2 (of early drops) | P2 timeouts (of P2 rejections) | P2 served in time "
          "| bench plan: P2 timeouts (of P2 rejections) | P2 served in time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, classes in variants.items():
        drops: Counter[int] = Counter()
        wrong: Counter[int] = Counter()
        p2_to = p2_served = 0
        for s in seeds:
            limit, history = random_history(s)
            o = replay(limit, classes, history)
            drops.update(history[i].cls for i in o.early_drops())
            wrong.update(history[i].cls for i in wrong_drops_at_current_rate(o, classes, history))
            for i, a in enumerate(history):
                if a.cls == 2:
                    d = o.decisions[i]
                    in_time = served(o, i)
                    p2_served += in_time
                    p2_to += d == "queued" and not in_time
        bt, bd, bs = p2_outcomes(classes, bench_seeds)
        w = " / ".join(f"{wrong[k]} ({drops[k]})" for k in range(3))
        print(f"| {name} | {w} | {p2_to} ({100 * p2_to / max(1, p2_to + drops[2]):.1f} %) | {p2_served} "
              f"| {bt} ({100 * bt / max(1, bt + bd):.1f} %) | {bs} |", flush=True)


def variety(seeds: range) -> None:
    """P2 with and without its reject target on other seeds and priority mixes of the bench's
    plan (burst and sparse phase, limits 96 and 107), without and with the shipped onset ramp."""
    pool = PoolConfig()
    shipped = pool.classes
    lenient = {**shipped, 2: shipped[2].model_copy(update={"slo_reject_s": 0.0, "early_drop_min_chance": 0.5})}
    print("| mix P0/P1/P2 | onset ramp | P2 waits at 0.5: timeouts (of P2 rejections), served in time "
          "| shipped: timeouts (of P2 rejections), served in time |")
    print("|---|---|---:|---:|")
    for mix in ((0.1, 0.6, 0.3), (0.3, 0.4, 0.3), (0.2, 0.3, 0.5)):
        for ramp in (None, (pool.onset_ramp_burst, pool.onset_ramp_rate)):
            cells = []
            for classes in (lenient, shipped):
                to, dr, sv = p2_outcomes(classes, seeds, ramp=ramp, mix=mix)
                cells.append(f"{to} ({100 * to / max(1, to + dr):.1f} %), {sv}")
            print(f"| {' / '.join(f'{m:g}' for m in mix)} | {'on' if ramp else 'off'} | {cells[0]} | {cells[1]} |", flush=True)


def p0p1(chances: list[float], seeds: range, shape_seeds: range) -> None:
    """P0 and P1's minimum chance alone (P2 as shipped, with its reject target): per class wrong
    drops, requests served in time and queue timeouts over the random histories and over
    `tests.policy_variety`'s shapes (issue 9's last wrong drops; docs/admission.md)."""
    import tests.policy_variety as pv

    shipped = PoolConfig().classes
    print("| P0/P1 min chance | histories: P0 / P1 wrong drops | served in time | queue timeouts "
          "| shapes: P0 / P1 wrong drops | served in time | queue timeouts |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    runs = [[random_history(s) for s in seeds], [pv.shape(name, s) for name in pv.SHAPES for s in shape_seeds]]
    for chance in chances:
        classes = {k: (c.model_copy(update={"early_drop_min_chance": chance}) if k < 2 else c) for k, c in shipped.items()}
        cells = []
        for histories in runs:
            wrong: Counter[int] = Counter()
            in_time: Counter[int] = Counter()
            timeouts: Counter[int] = Counter()
            for limit, history in histories:
                o = replay(limit, classes, history)
                wrong.update(history[i].cls for i in wrong_drops_at_current_rate(o, classes, history, only=(0, 1)))
                for i, a in enumerate(history):
                    d = o.decisions[i]
                    ok = served(o, i)
                    in_time[a.cls] += ok
                    timeouts[a.cls] += d == "queued" and not ok
            cells += [f"{wrong[0]} / {wrong[1]}", f"{in_time[0]} / {in_time[1]}", f"{timeouts[0]} / {timeouts[1]}"]
        print(f"| {chance:.2f} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("chances", nargs="*", type=float, default=[0.3, 0.5, 0.7, 0.8, 0.9, 0.95])
    p.add_argument("--seeds", type=int, default=40, help="random histories (the property test's)")
    p.add_argument("--burst-seeds", type=int, default=4)
    p.add_argument("--reject-target", action="store_true",
                   help="instead: P2 with and without its reject target (slo_reject_s), per-class wrong drops")
    p.add_argument("--variety", action="store_true",
                   help="instead: P2 with and without its reject target on bench seeds 4-7, three mixes, ramp off/on")
    p.add_argument("--p0p1", action="store_true",
                   help="instead: only P0 and P1's minimum chance at each value (P2 as shipped), over the random "
                        "histories and the policy_variety shapes (2 seeds each)")
    args = p.parse_args(argv)
    if args.p0p1:
        p0p1(args.chances, range(args.seeds), range(2))
        return 0
    if args.variety:
        variety(range(4, 8))
        return 0
    if args.reject_target:
        reject_target(range(args.seeds), range(args.burst_seeds))
        return 0
    print("| min chance | random: early drops | wrong drops | queue timeouts (of rejections) | served in time "
          "| bench burst: P2 drops | P2 timeouts (of P2 rejections) | P2 served in time | all served |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for chance in args.chances:
        m = measure(chance, range(args.seeds), range(args.burst_seeds))
        r, b = m["random"], m["burst"]
        rej = r["drops"] + r["timeouts"]
        p2rej = b["p2_drops"] + b["p2_timeouts"]
        print(f"| {chance:.2f} | {r['drops']} | {r['wrong']} ({100 * r['wrong'] / max(1, r['drops']):.2f} %) "
              f"| {r['timeouts']} ({100 * r['timeouts'] / max(1, rej):.1f} %) | {r['served']} "
              f"| {b['p2_drops']} | {b['p2_timeouts']} ({100 * b['p2_timeouts'] / max(1, p2rej):.1f} %) "
              f"| {b['p2_served']} | {b['served']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
