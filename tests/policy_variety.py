"""Early drop and Retry-After on arrival shapes the project's replay tests do not use.

Run: .venv/bin/python -m tests.policy_variety [shape ...]  (an independent review wrote it)
Uses tests/policy_replay.py (the project's own fake-clock replay of policy + grant loop).

Per shape and seed: early drops per class; "wrong" drops by the project's own criterion
(wrong_drops_at_current_rate: the real grant loop from the exact state, releases at the current
rate, the higher-class arrivals that really came, would have granted it in time); a sampled
counterfactual (wrongly_dropped: replay with that request enqueued — granted in time AND its
class served more in time); queue timeouts of P0/P1; Retry-After vs the actual time until the
class was next granted a permit in the replay.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
import zlib

from floodgate.extproc.config import PoolConfig

from tests.policy_replay import (
    Arrival,
    replay,
    served_by_promise,
    wrong_drops_at_current_rate,
    wrongly_dropped,
)

SHIPPED = PoolConfig().classes


def gen(rng, rate_fn, t_end, mix_fn, service_fn, tenant_fn, dt=0.05):
    """Non-homogeneous Poisson by thinning; rate_fn(t) in req/s; mix_fn(t) -> class shares."""
    out = []
    rmax = max(rate_fn(k * dt) for k in range(int(t_end / dt) + 1)) * 1.05 + 1e-9
    t = 0.0
    while True:
        t += rng.expovariate(rmax)
        if t >= t_end:
            break
        if rng.random() * rmax > rate_fn(t):
            continue
        m = mix_fn(t)
        u, cls = rng.random() * sum(m), 0
        while u > m[cls]:
            u -= m[cls]
            cls += 1
        out.append(Arrival(t, cls, service_fn(rng), tenant_fn(rng)))
    return out


def expo(mean):
    return lambda rng: rng.expovariate(1 / mean)


def pareto(mean, alpha=1.3):
    xm = mean * (alpha - 1) / alpha
    return lambda rng: min(xm * rng.paretovariate(alpha), 600.0)


def bimodal(short, long_, p_long):
    return lambda rng: rng.expovariate(1 / (long_ if rng.random() < p_long else short))


MIX = (0.2, 0.5, 0.3)


def shape(name, seed):
    """-> (limit, history). cap = limit / mean service."""
    rng = random.Random(seed * 1000 + zlib.crc32(name.encode()) % 997)
    two = lambda r: r.choice("ab")  # noqa: E731
    if name == "diurnal":  # slow sine 0.3x..2.5x over 240 s
        L, S = 32, 2.0
        cap = L / S
        return L, gen(rng, lambda t: cap * (1.4 - 1.1 * math.cos(2 * math.pi * t / 240)), 240, lambda t: MIX, expo(S), two)
    if name == "flash":  # 0.5x, then a 10x flash crowd for 8 s, then 0.5x
        L, S = 48, 3.0
        cap = L / S
        return L, gen(rng, lambda t: cap * (10 if 30 <= t < 38 else 0.5), 90, lambda t: MIX, expo(S), two)
    if name == "onoff":  # 4x for 4 s, 0.1x for 8 s, repeated
        L, S = 24, 1.5
        cap = L / S
        return L, gen(rng, lambda t: cap * (4 if (t % 12) < 4 else 0.1), 120, lambda t: MIX, expo(S), two)
    if name == "heavytail":  # Pareto(1.3) hold times (long decodes), 1.5x
        L, S = 32, 2.0
        cap = L / S
        return L, gen(rng, lambda t: cap * 1.5, 150, lambda t: MIX, pareto(S), two)
    if name == "bimodal":  # prompt-heavy short (0.3 s) vs decode-heavy long (12 s), 15 % long, 2x
        L = 32
        S = 0.85 * 0.3 + 0.15 * 12
        cap = L / S
        return L, gen(rng, lambda t: cap * 2.0, 150, lambda t: MIX, bimodal(0.3, 12, 0.15), two)
    if name == "mostlyp0":  # 85 % P0 at 2x
        L, S = 32, 2.0
        cap = L / S
        return L, gen(rng, lambda t: cap * 2.0, 120, lambda t: (0.85, 0.1, 0.05), expo(S), two)
    if name == "p0ramp":  # P0 only, ramp 0.5x -> 3x -> 0.5x
        L, S = 32, 2.0
        cap = L / S
        return L, gen(rng, lambda t: cap * (0.5 + 2.5 * max(0.0, 1 - abs(t - 60) / 40)), 120, lambda t: (1, 0, 0), expo(S), two)
    if name == "tenants":  # 40 Zipf tenants, 2x
        L, S = 32, 2.0
        cap = L / S
        w = [1 / (k + 1) for k in range(40)]
        return L, gen(rng, lambda t: cap * 2.0, 120, lambda t: MIX,
                      expo(S), lambda r: f"t{r.choices(range(40), w)[0]}")
    if name == "sparse":  # P1 at 2x, P0 0.05/s sparse, P2 sparse
        L, S = 16, 1.0
        cap = L / S
        return L, gen(rng, lambda t: cap * 2.0, 150, lambda t: (0.003, 0.99, 0.007), expo(S), two)
    if name == "bigpool":  # limit 256, short requests, 1.3x with a step to 2.5x
        L, S = 256, 4.0
        cap = L / S
        return L, gen(rng, lambda t: cap * (1.3 if t < 40 else 2.5), 80, lambda t: MIX, expo(S), two)
    if name == "tinypool":  # limit 2, long requests, 1.5x
        L, S = 2, 6.0
        cap = L / S
        return L, gen(rng, lambda t: cap * 1.5, 900, lambda t: MIX, expo(S), two)
    if name == "p1only":  # P1 only at 1.2x, long-ish
        L, S = 16, 3.0
        cap = L / S
        return L, gen(rng, lambda t: cap * 1.2, 200, lambda t: (0, 1, 0), expo(S), two)
    if name == "slowpool":  # one 8-slot replica, 10 s generations (0.8 releases/s), 2x, P0-heavy
        L, S = 8, 10.0
        cap = L / S
        return L, gen(rng, lambda t: cap * 2.0, 600, lambda t: (0.5, 0.4, 0.1), expo(S), two)
    raise KeyError(name)


SHAPES = ["diurnal", "flash", "onoff", "heavytail", "bimodal", "mostlyp0", "p0ramp", "tenants", "sparse",
          "bigpool", "tinypool", "p1only", "slowpool"]


def next_grant_times(history, out):
    """per class: sorted arrival times of requests of that class that were served in time (a
    retry arriving then would have been admitted: the time capacity was really there for it)."""
    g = {0: [], 1: [], 2: []}
    for i, a in enumerate(history):
        d = out.decisions[i]
        if i in out.granted_at and (d == "immediate" or out.granted_at[i] <= out.deadline[i]):
            g[a.cls].append(a.t)
    return g


def run(name, seeds, sample_cf=6):
    import bisect
    res = {"shape": name, "per_class": {k: dict(n=0, drops=0, wrong=0, cf_checked=0, cf_wrong=0, timeouts=0, queued=0,
                                             served=0) for k in range(3)},
           "retry": {k: [] for k in range(3)}, "examples": []}
    for seed in seeds:
        limit, hist = shape(name, seed)
        out = replay(limit, SHIPPED, hist)
        wrong = set(wrong_drops_at_current_rate(out, SHIPPED, hist))
        cf = set()
        drops01 = [i for i in out.early_drops() if hist[i].cls < 2]
        if drops01 and sample_cf:
            cf = set(wrongly_dropped(limit, SHIPPED, hist, out, sample=sample_cf, judged=(0, 1)))
            res["per_class"][0]["cf_checked"] += 0  # counted below per class
        sampled = drops01 if len(drops01) <= sample_cf else [drops01[int(k * len(drops01) / sample_cf)] for k in range(sample_cf)]
        grants = next_grant_times(hist, out)
        end = hist[-1].t
        for i, a in enumerate(hist):
            pc = res["per_class"][a.cls]
            pc["n"] += 1
            d = out.decisions[i]
            ok = i in out.granted_at and (d == "immediate" or out.granted_at[i] <= out.deadline[i])
            pc["served"] += ok
            if d == "early_drop":
                pc["drops"] += 1
                pc["wrong"] += i in wrong
                if i in wrong and len(res["examples"]) < 6:
                    res["examples"].append(dict(seed=seed, i=i, t=round(a.t, 3), cls=a.cls, limit=limit))
            if d == "queued":
                pc["queued"] += 1
                pc["timeouts"] += not ok
            if i in out.retry_after:
                ra = out.retry_after[i]
                g = grants[a.cls]
                j = bisect.bisect_right(g, a.t)
                actual = g[j] - a.t if j < len(g) else None
                if actual is None and end - a.t < 60:
                    continue  # censored by the history's end
                res["retry"][a.cls].append((ra, actual if actual is not None else math.inf))
        for i in sampled:
            res["per_class"][hist[i].cls]["cf_checked"] += 1
            res["per_class"][hist[i].cls]["cf_wrong"] += i in cf
    return res


def summarize(res):
    lines = [f"== {res['shape']}"]
    for k, pc in res["per_class"].items():
        if pc["n"] == 0:
            continue
        rate = pc["wrong"] / pc["drops"] if pc["drops"] else 0
        lines.append(f"  P{k}: n={pc['n']} served_in_time={pc['served']} early_drops={pc['drops']} wrong@rate={pc['wrong']}"
                     f" ({100 * rate:.2f} %) cf_wrong={pc['cf_wrong']}/{pc['cf_checked']} queued={pc['queued']} "
                     f"timeouts={pc['timeouts']}")
    for k, rs in res["retry"].items():
        if not rs:
            continue
        fin = [(r, a) for r, a in rs if a != math.inf]
        never = len(rs) - len(fin)
        if fin:
            ratios = sorted(r / max(a, 1e-3) for r, a in fin)
            early = sum(1 for r, a in fin if r < a) / len(fin)
            late3 = sum(1 for r, a in fin if r > max(3 * a, 2)) / len(fin)
            med_a = statistics.median(a for _, a in fin)
            med_r = statistics.median(r for r, _ in fin)
            lines.append(f"  RA P{k}: n={len(rs)} never_freed={never} median told={med_r}s actual={med_a:.2f}s "
                         f"ratio p10/p50/p90={ratios[len(ratios) // 10]:.2f}/{ratios[len(ratios) // 2]:.2f}/"
                         f"{ratios[9 * len(ratios) // 10]:.2f} told<actual={100 * early:.0f}% told>max(3x,2s)={100 * late3:.0f}%")
        else:
            lines.append(f"  RA P{k}: n={len(rs)} never_freed={never}")
    if res["examples"]:
        lines.append(f"  wrong-drop examples: {res['examples']}")
    return "\n".join(lines)


def served_counts(name: str, seeds: range) -> dict[tuple[int, str], tuple[int, int]]:
    """How often the P0/P1 requests early drop let wait were served in time, by the chance the
    rule read for them (rates at their bound): 0.5-0.99 (`mid`), >= 0.99 (`sure`), too few
    releases to read (`unsure`: waits regardless), below the class's minimum (`budget`: let in
    by a slow-rejection budget). (class, bucket) -> (served in time, let wait). The property
    test's other side
    (tests/test_policy_replay.py::test_requests_let_wait_are_served_as_often_as_early_drop_promised)."""
    counts: dict[tuple[int, str], tuple[int, int]] = {}
    for seed in seeds:
        limit, history = shape(name, seed)
        served_by_promise(replay(limit, SHIPPED, history), SHIPPED, history, counts)
    return dict(sorted(counts.items()))


def served_as_promised(name: str, seeds: range) -> str:
    """`served_counts` as one line."""
    cells = [f"P{k[0]} {k[1]}: {ok}/{n} ({ok / n:.0%})" for k, (ok, n) in served_counts(name, seeds).items()]
    return f"== {name}: served in time / let wait  " + "  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", metavar="shape", help=f"shapes to run (default: all of {', '.join(SHAPES)})")
    p.add_argument("--seeds", type=int, default=3, help="seeds per shape (default: %(default)s)")
    p.add_argument("--served", action="store_true",
                   help="instead: how often the P0/P1 waits early drop let in were served in time, by the chance it read")
    args = p.parse_args(argv)
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    for name in args.shapes or SHAPES:
        t0 = time.time()
        if args.served:
            print(served_as_promised(name, range(args.seeds)), flush=True)
            continue
        print(summarize(run(name, range(args.seeds))), f"  [{time.time() - t0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
