"""`floodgate extproc`: run the Envoy ext_proc admission processor."""

from __future__ import annotations

import argparse
import logging
import sys

from floodgate.extproc.config import ConfigError, load_config

from floodgate.yamlconfig import dump_redacted

HELP = """\
Run the Envoy external processor that admits, queues (P0 > P1 > P2) or rejects (429 with
Retry-After) every request of the configured pools. All processes pointed at the same Redis
share one limit, one set of leases and one queue per pool. Flags override the config file,
which overrides the defaults; FLOODGATE_REDIS_URL, FLOODGATE_LISTEN, FLOODGATE_METRICS_LISTEN,
FLOODGATE_GATEWAY_ID and FLOODGATE_REDIS_PASSWORD override the file too.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("extproc", help="run the ext_proc admission processor",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file (see docs/configuration.md)")
    p.add_argument("--listen", metavar="HOST:PORT", help="gRPC listen address (default 127.0.0.1:50051)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="Prometheus /metrics address (default 127.0.0.1:9464; '' disables)")
    p.add_argument("--redis-url", metavar="URL",
                   help="shared state: redis://, rediss://, redis+sentinel://h1:26379,h2/service or "
                        "redis+cluster://h1:6379,h2:6379 (docs/operations.md)")
    p.add_argument("--gateway-id", metavar="ID", help="unique id of this process (default host-pid-random)")
    p.add_argument("--check-config", action="store_true", help="validate the config, print it, and exit")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default: info)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config, {
            ("server", "listen"): args.listen,
            ("server", "metrics_listen"): args.metrics_listen,
            ("redis", "url"): args.redis_url,
            ("server", "gateway_id"): args.gateway_id,
        })
    except ConfigError as exc:
        print(f"floodgate extproc: {exc}", file=sys.stderr)
        return 2
    for warning in (w for pool in cfg.pools for w in pool.class_warnings()):
        logging.getLogger("floodgate.config").warning("%s", warning)
    if args.check_config:
        print(dump_redacted(cfg))
        return 0
    from floodgate.extproc.app import serve

    from floodgate.runtime import run_until_signalled

    run_until_signalled(lambda stop: serve(cfg, stop))
    return 0
