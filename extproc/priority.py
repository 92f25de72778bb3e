"""Which priority class a request gets (pure).

The priority header is honoured only from trusted callers: a source address inside a
configured CIDR, or an mTLS peer whose URI SAN (SPIFFE ID) is configured. Everyone else gets
the priority their tenant maps to, else the default. A header that cannot be parsed never
fails the request: it falls back and is reported so the caller can count it.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from functools import cached_property

from floodgate.extproc.config import AdmissionConfig

_NAMES = {"critical": 0, "standard": 1, "sheddable": 2, "p0": 0, "p1": 1, "p2": 2}
MAX_HEADER_LEN = 64  # longer values are garbage, not a priority


def parse_priority(value: str | None) -> int | None:
    """`0|1|2|critical|standard|sheddable` (case-insensitive, surrounding space ignored) or None."""
    if value is None:
        return None
    v = value.strip().lower()
    if not v or len(v) > MAX_HEADER_LEN:
        return None
    if v in ("0", "1", "2"):
        return int(v)
    return _NAMES.get(v)


@dataclass(frozen=True)
class Caller:
    """What Envoy told us about the caller (from request attributes and headers)."""

    source_ip: str | None = None
    mtls: bool = False
    peer_uri_sans: tuple[str, ...] = ()
    tenant: str | None = None
    priority_values: tuple[str, ...] = ()  # every value of the priority header, in order

    @property
    def identity(self) -> str:
        """Who this is, as far as Envoy vouches for it: the mTLS peer's SPIFFE ID, else the
        source address ("" when Envoy sent neither)."""
        if self.mtls and self.peer_uri_sans:
            return self.peer_uri_sans[0]
        return self.source_ip or ""


@dataclass(frozen=True)
class PriorityDecision:
    priority: int
    source: str  # "header" | "spiffe" | "tenant" | "default"
    invalid_header: bool  # a header was present but unusable (garbage or conflicting duplicates)
    untrusted_header: bool  # a header was present from a caller we do not trust


def source_ip_of(address: str | None) -> str | None:
    """`127.0.0.1:55714` / `[::1]:80` / bare IP -> IP string, or None if unparseable."""
    if not address:
        return None
    a = address.strip()
    if a.startswith("["):
        a = a[1:].split("]", 1)[0]
    elif a.count(":") == 1:
        a = a.rsplit(":", 1)[0]
    return _canonical_ip(a)


@functools.lru_cache(maxsize=65536)
def _canonical_ip(text: str) -> str | None:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    # An IPv4 client of a dual-stack listener (`[::]` with ipv4_compat) arrives as
    # `[::ffff:10.1.2.3]:port`: it is that IPv4 address, and must match IPv4 trust CIDRs.
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


class PriorityResolver:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg

    @cached_property
    def _networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(c, strict=False) for c in self.cfg.trust.cidrs]

    def _spiffe_trusted(self, sans: tuple[str, ...]) -> bool:
        for san in sans:
            for allowed in self.cfg.trust.spiffe_ids:
                if san == allowed or (allowed.endswith("/") and san.startswith(allowed)):
                    return True
        return False

    def trusted(self, caller: Caller) -> bool:
        if caller.mtls and self._spiffe_trusted(caller.peer_uri_sans):
            return True
        if caller.source_ip and self._networks:
            return self._ip_trusted(caller.source_ip)
        return False

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one resolver per process, bounded cache
    def _ip_trusted(self, source_ip: str) -> bool:
        try:
            ip = ipaddress.ip_address(source_ip)
        except ValueError:
            return False
        return any(ip in net for net in self._networks)

    def resolve(self, caller: Caller) -> PriorityDecision:
        header: int | None = None
        invalid = False
        if caller.priority_values:
            # Repeated values, on lines of their own or comma-joined (Envoy joins a value an
            # auth filter appends so), must agree; anything unparseable poisons the header.
            parsed = {parse_priority(item) for v in caller.priority_values
                      for item in (v.split(",") if len(v) <= 4 * MAX_HEADER_LEN else (v,))}
            if None in parsed or len(parsed) != 1:
                invalid = True
            else:
                header = parsed.pop()
        trusted = self.trusted(caller)
        if header is not None and trusted:
            return PriorityDecision(header, "header", False, False)
        untrusted = bool(caller.priority_values) and not trusted
        if caller.mtls:
            for san in caller.peer_uri_sans:
                if san in self.cfg.trust.spiffe_priorities:
                    return PriorityDecision(self.cfg.trust.spiffe_priorities[san], "spiffe", invalid, untrusted)
        if caller.tenant is not None and caller.tenant in self.cfg.tenant_priorities:
            return PriorityDecision(self.cfg.tenant_priorities[caller.tenant], "tenant", invalid, untrusted)
        return PriorityDecision(self.cfg.default_priority, "default", invalid, untrusted)
