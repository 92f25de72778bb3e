"""Priority parsing and the trust rules (pure)."""

from __future__ import annotations

import pytest
from floodgate.extproc.config import AdmissionConfig, TrustConfig
from floodgate.extproc.priority import Caller, PriorityResolver, parse_priority, source_ip_of

CFG = AdmissionConfig(
    default_priority=1,
    tenant_priorities={"gold": 0, "batch": 2},
    trust=TrustConfig(cidrs=["10.0.0.0/8", "fd00::/8"], spiffe_ids=["spiffe://prod/ns/frontend/", "spiffe://prod/sa/exact"],
                      spiffe_priorities={"spiffe://prod/sa/batch-job": 2}),
)
R = PriorityResolver(CFG)


@pytest.mark.parametrize(("raw", "want"), [
    ("0", 0), ("1", 1), ("2", 2), (" 2 ", 2), ("critical", 0), ("STANDARD", 1), ("sheddable", 2), ("P0", 0),
    ("3", None), ("-1", None), ("", None), ("high", None), ("1" * 100, None), ("0x1", None), (None, None),
])
def test_parse_priority(raw: str | None, want: int | None) -> None:
    assert parse_priority(raw) == want


@pytest.mark.parametrize(("addr", "ip"), [
    ("127.0.0.1:55714", "127.0.0.1"), ("[::1]:80", "::1"), ("10.1.2.3", "10.1.2.3"), ("garbage", None), (None, None),
    # An IPv4 client through a dual-stack listener: the IPv4 address it is (was never trusted).
    ("[::ffff:10.1.2.3]:4711", "10.1.2.3"), ("[::ffff:a01:203]:80", "10.1.2.3"),
])
def test_source_ip(addr: str | None, ip: str | None) -> None:
    assert source_ip_of(addr) == ip


def test_an_ipv4_client_of_a_dual_stack_listener_is_trusted_by_its_ipv4_cidr() -> None:
    ip = source_ip_of("[::ffff:10.2.3.4]:5000")
    assert R.resolve(Caller(source_ip=ip, priority_values=("0",))).priority == 0


def test_trusted_cidr_header_honoured() -> None:
    d = R.resolve(Caller(source_ip="10.2.3.4", priority_values=("0",)))
    assert (d.priority, d.source, d.untrusted_header) == (0, "header", False)
    assert R.resolve(Caller(source_ip="fd00::1", priority_values=("2",))).priority == 2


def test_untrusted_header_ignored_and_reported() -> None:
    d = R.resolve(Caller(source_ip="192.168.1.1", priority_values=("0",)))
    assert (d.priority, d.source, d.untrusted_header) == (1, "default", True)


def test_untrusted_caller_gets_tenant_priority() -> None:
    d = R.resolve(Caller(source_ip="192.168.1.1", tenant="gold", priority_values=("2",)))
    assert (d.priority, d.source) == (0, "tenant")


def test_spiffe_prefix_and_exact_trust() -> None:
    assert R.resolve(Caller(mtls=True, peer_uri_sans=("spiffe://prod/ns/frontend/sa/web",), priority_values=("0",))).priority == 0
    assert R.resolve(Caller(mtls=True, peer_uri_sans=("spiffe://prod/sa/exact",), priority_values=("0",))).priority == 0
    # a SAN without mTLS is not an identity
    assert R.resolve(Caller(mtls=False, peer_uri_sans=("spiffe://prod/sa/exact",), priority_values=("0",))).priority == 1
    assert R.resolve(Caller(mtls=True, peer_uri_sans=("spiffe://prod/sa/exactly",), priority_values=("0",))).priority == 1


def test_spiffe_priority_mapping() -> None:
    d = R.resolve(Caller(mtls=True, peer_uri_sans=("spiffe://prod/sa/batch-job",)))
    assert (d.priority, d.source) == (2, "spiffe")


@pytest.mark.parametrize("values", [("garbage",), ("0", "2"), ("x" * 5000,), ("",)])
def test_bad_headers_fall_back_and_are_flagged(values: tuple[str, ...]) -> None:
    d = R.resolve(Caller(source_ip="10.0.0.1", priority_values=values))
    assert d.priority == 1 and d.invalid_header


def test_agreeing_duplicates_are_fine() -> None:
    d = R.resolve(Caller(source_ip="10.0.0.1", priority_values=("0", "critical")))
    assert d.priority == 0 and not d.invalid_header


def test_no_header_is_default() -> None:
    d = R.resolve(Caller(source_ip="10.0.0.1"))
    assert (d.priority, d.invalid_header, d.untrusted_header) == (1, False, False)


@pytest.mark.parametrize(("values", "want", "invalid"), [
    (("0", "0"), 0, False),          # two header lines that agree
    (("0, 0",), 0, False),           # the same, comma-joined (an auth filter that appends)
    (("critical,0",), 0, False),
    (("0, 2",), 1, True),            # conflicting: invalid, the default applies
    (("0,",), 1, True),              # an empty item is no priority
    (("0," * 200,), 1, True),        # long: not split, garbage
])
def test_a_comma_joined_priority_header_is_read_as_its_values(values: tuple[str, ...], want: int,
                                                              invalid: bool) -> None:
    # A review: `x-request-priority: 0, 0` from a trusted caller fell back to the default (P1)
    # while two lines of `0` gave P0; the tenant header already reads comma lists.
    d = R.resolve(Caller(source_ip="10.2.3.4", priority_values=values))
    assert (d.priority, d.invalid_header) == (want, invalid)


def test_the_callers_identity_is_its_spiffe_id_under_mtls_else_its_address() -> None:
    """Mutation review: `Caller.identity` (what admission records the request's caller as) is
    the mTLS peer's SPIFFE ID only when there is one; an mTLS peer whose certificate has no URI
    SAN (DNS names only) and a plain caller are their source address. Neither was tested: an
    `or` for the `and` indexed an empty SAN list (IndexError on the request path)."""
    assert Caller(source_ip="10.0.0.7").identity == "10.0.0.7"
    assert Caller(source_ip="10.0.0.7", mtls=True).identity == "10.0.0.7"
    assert Caller(source_ip="10.0.0.7", mtls=True, peer_uri_sans=("spiffe://prod/sa/web",)).identity == \
        "spiffe://prod/sa/web"
    assert Caller().identity == ""
