"""Where a processor may send a request, whatever Redis says.

With endpoint picking the destination (`x-gateway-destination-endpoint`, which Envoy's
ORIGINAL_DST cluster connects to) comes from the replica registry in Redis. Whoever can write
that registry could send prompts to any host; Redis ACLs (floodgate/redis_acl.py) keep the
processors from writing it, and this guard is the second line: a pool's `allowed_endpoints`
(CIDRs, optionally with a port or port range) bounds every endpoint the processor routes to.
An endpoint outside it, or not a literal `ip:port`, is refused: the request gets 503
`no_endpoints` and the permit goes back (extproc/picking.py).

Rules: "10.0.0.0/8" (any port), "10.0.0.0/8:8000", "10.0.0.0/8:8000-8099", "[fd00::/8]:8000".
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

log = logging.getLogger("floodgate.endpoint_guard")


@dataclass(frozen=True)
class AllowRule:
    network: IPNetwork
    ports: tuple[int, int] | None = None  # inclusive range; None: any port

    def allows(self, ip: IPAddress, port: int) -> bool:
        if ip.version != self.network.version or ip not in self.network:
            return False
        return self.ports is None or self.ports[0] <= port <= self.ports[1]


def _split_host_port(text: str) -> tuple[str, str | None]:
    """"[v6]:port", "[v6]", "v4:port", "v4" (also "v4/len:port") -> (host, port or None)."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"{text!r}: unclosed '['")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected ':port' after ']'")
        return host, rest[1:] if rest else None
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, port
    return text, None


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{what}: {text!r} is not a port (1-65535)")
    return int(text)


def parse_rule(text: str) -> AllowRule:
    """One `allowed_endpoints` entry; ValueError says what is wrong with it."""
    host, port = _split_host_port(text.strip())
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {host!r} is not a CIDR") from exc
    if port is None:
        return AllowRule(network)
    lo, _, hi = port.partition("-")
    ports = (_port(lo, text), _port(hi or lo, text))
    if ports[0] > ports[1]:
        raise ValueError(f"{text!r}: empty port range")
    return AllowRule(network, ports)


def parse_endpoint(endpoint: str) -> tuple[IPAddress, int] | None:
    """A literal "ip:port" or "[ipv6]:port"; None for anything else (hostnames included:
    ORIGINAL_DST connects to an address, and a name could resolve anywhere)."""
    try:
        host, port = _split_host_port(endpoint)
        if port is None:
            return None
        return ipaddress.ip_address(host), _port(port, endpoint)
    except ValueError:
        return None


def endpoint_allowed(endpoint: str, rules: Sequence[AllowRule]) -> bool:
    parsed = parse_endpoint(endpoint)
    return parsed is not None and any(r.allows(*parsed) for r in rules)


def make_guard(pool: str, entries: Sequence[str]) -> Callable[[str], bool] | None:
    """The `accept` hook of a pool's picker; None when the pool sets no allowlist."""
    if not entries:
        return None
    rules = tuple(parse_rule(e) for e in entries)
    refused: set[str] = set()

    def accept(endpoint: str) -> bool:
        if endpoint_allowed(endpoint, rules):
            return True
        if endpoint not in refused and len(refused) < 1000:  # say it once per endpoint
            refused.add(endpoint)
            log.error("pool %s: the registry lists endpoint %r, outside allowed_endpoints %s: refused",
                      pool, endpoint, list(entries))
        return False

    return accept
