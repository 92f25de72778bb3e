"""Least-privilege Redis ACL users for Floodgate (Redis 7 / Valkey ACL syntax).

Two users besides the operator's `default`:

* `floodgate-processor` may read every pool key and write the admission keys (leases, queues,
  counts, limit state, per-endpoint load `epinf`, ...), but NOT the replica registry that
  decides where traffic goes: `fg:{pool}:active`, `fg:{pool}:endpoints` (read-only) and the
  controller's `fg:{pool}:ctl:*` keys. It publishes and subscribes on its per-pool channels
  `fg:{pool}:gw:<gateway>` only.
* `floodgate-controller` owns the registry, its history and the leader lease: all `fg:*` keys.

Neither may run dangerous or admin commands (FLUSHALL, KEYS, CONFIG, ...).

How the processor rules work: Redis checks FCALL's (and EVAL/EVALSHA's) declared keys as if the
script wrote all of them, and the processor's one script declares the registry keys it only
reads. So the processor's root permissions give read on `fg:{*}:*` and write on every pool key
except the registry (glob character classes: suffixes not starting with a/e/c, plus `e[^n]*`,
`c[^t]*`), and a selector allows FCALL/FCALL_RO (and EVAL/EVALSHA, for a server without
Functions) with any pool key, and FUNCTION LOAD of the processor's library. Every command the script runs is checked
against the user again, so a script, ours or an attacker's, still cannot write the registry.
The exclusions are by first letters, so admission keys added later keep working unless they
start with `a`, `en` or `ct` (tests/test_security.py runs the real processor under this user).

    python -m floodgate.redis_acl   # the ACL lines, passwords as $REDIS_*_PASSWORD
"""

from __future__ import annotations

import sys

PROCESSOR_USER = "floodgate-processor"
CONTROLLER_USER = "floodgate-controller"

# Scripting minus what removes or swaps code under another user's feet (FUNCTION FLUSH / DELETE /
# RESTORE, SCRIPT FLUSH). FUNCTION LOAD REPLACE stays (processors load their library so); the
# reads of the controller and of `floodgate status` go by FCALL_RO, so a library loaded in our
# name can never write with their rights.
_COMMANDS = ("-@all +@connection +@read +@write +@transaction +@scripting +@pubsub +time -@dangerous -@admin "
             "-function|flush -function|delete -function|restore -script|flush")

PROCESSOR_RULES = (
    f"resetkeys resetchannels {_COMMANDS} "
    "%R~fg:{*}:* ~fg:{*}:[^aec]* ~fg:{*}:e[^n]* ~fg:{*}:c[^t]* &fg:{*}:gw:* "
    "(+fcall +fcall_ro +function|load +evalsha +eval +script|load ~fg:{*}:*)"
)
CONTROLLER_RULES = f"resetkeys resetchannels {_COMMANDS} ~fg:* &fg:*"


def acl_lines(*, admin_password: str, processor_password: str, controller_password: str) -> list[str]:
    """An ACL file (one `user` line each): `default` is the operator's full-access user."""
    return [
        f"user default on >{admin_password} ~* &* +@all",
        f"user {PROCESSOR_USER} on >{processor_password} {PROCESSOR_RULES}",
        f"user {CONTROLLER_USER} on >{controller_password} {CONTROLLER_RULES}",
    ]


def shell_template() -> list[str]:
    """The lines as the shipped Redis start scripts write them (passwords from the env)."""
    return acl_lines(admin_password="$REDIS_PASSWORD", processor_password="$REDIS_PROCESSOR_PASSWORD",
                     controller_password="$REDIS_CONTROLLER_PASSWORD")


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="python -m floodgate.redis_acl",
        description="Print the ACL file of Floodgate's Redis users (one `user` line each: `default` the "
                    "operator's, floodgate-processor, floodgate-controller; see this module's doc), with the "
                    "passwords as $REDIS_PASSWORD, $REDIS_PROCESSOR_PASSWORD and $REDIS_CONTROLLER_PASSWORD for "
                    "a start script to substitute.").parse_args(argv)
    sys.stdout.write("\n".join(shell_template()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
