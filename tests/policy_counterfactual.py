"""How often early drop turns away a request its class would have served in time, counted the
way a user would: the whole history replayed with that one request enqueued instead
(`tests.policy_replay.wrongly_dropped`: real service times, every other request decided by the
rule, and the drop is wrong only if the request is then granted before its deadline AND its
class serves more requests in time). Each judgement is a full replay, so the drops are sampled
evenly per history and class.

    .venv/bin/python -m tests.policy_counterfactual [--per-class N] [--seeds A:B]

On the 40 histories of tests/test_policy_replay.py (`--per-class 6`, ~2 min): see
docs/admission.md, "Early drop", "How often a drop is wrong".
"""

from __future__ import annotations

import argparse

from tests.policy_replay import replay, wrongly_dropped
from tests.test_policy_replay import SHIPPED, random_history


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.policy_counterfactual", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-class", type=int, default=6, help="drops judged per history and class (default 6)")
    p.add_argument("--seeds", default="0:40", help="histories A:B (default 0:40)")
    args = p.parse_args(argv)
    a, b = (int(x) for x in args.seeds.split(":"))
    totals = {c: [0, 0, 0] for c in (0, 1)}  # drops, judged, wrong
    for seed in range(a, b):
        limit, history = random_history(seed)
        base = replay(limit, SHIPPED, history)
        for cls in (0, 1):
            drops = sum(1 for i in base.early_drops() if history[i].cls == cls)
            wrong = wrongly_dropped(limit, SHIPPED, history, base, sample=args.per_class, judged=(cls,))
            t = totals[cls]
            t[0] += drops
            t[1] += min(args.per_class, drops)
            t[2] += len(wrong)
    for cls, (drops, judged, wrong) in totals.items():
        share = f"{100 * wrong / judged:.0f} %" if judged else "-"
        print(f"P{cls}: {drops} early drops, {judged} judged, {wrong} wrong ({share})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
