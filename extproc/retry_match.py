"""Which admitted retries were counted before as turned away (pure: `now` is passed in).

A client's retry says so (`admission.retry_count_header`, OpenAI's SDKs' `x-stainless-retry-count`
above 0). Turned away again, it is no demand (`retried`): its first attempt was counted. Admitted,
it used to count as demand a second time — the first attempt's rejection and the retry's
admission are one request — so a burst that OpenAI's SDKs retried through read as more demand
than came, and the forecaster recorded it. Now an admitted retry is counted `retried_admitted`
(schema.RETRIED_ADMITTED), which the controller takes off the turned-away count of its class.

The header is the client's word, and so is the tenant header unless an auth step sets it, so a
retry is matched only against a first attempt of the same class, tenant and caller (the mTLS
peer's SPIFFE ID, else the source address Envoy saw: the client, or the last proxy you trust with
`xff_num_trusted_hops`) that this processor turned away within `window_s`: a client that marks its
own admitted requests as retries takes back only its own refusals, not other callers' (a
class-wide or tenant-wide match let a client's admitted traffic, under any tenant name, hide
everyone's refusals from the controller: a review cancelled 20 refusals of tenant `acme` and
tenant-less callers with 20 marked requests, and the turned-away demand read 2/s -> 0/s).
A retry that lands on another processor than its first attempt takes back only a first attempt
of the same caller that this one turned away, and one that comes later than `window_s` nothing:
then it counts as before (demand read high). A retry after an upstream error (its first attempt
admitted) may take back another first attempt of its caller that was never retried (demand read
low by one). Tenant-less requests of one caller share one key per class.
"""

from __future__ import annotations

from collections import OrderedDict

# Retries come within the Retry-After told (at most `admission.retry_after_max_s`, 60 s shipped)
# plus the client's own backoff: a first attempt is kept this much longer than the longest told.
WINDOW_S = 90.0
WINDOW_SLACK_S = 30.0
# (class, tenant, caller) entries kept; the least recently turned away go first (an evicted one
# takes nothing back: demand read high, as before)
MAX_KEYS = 4096
MAX_PER_KEY = 10_000


def window_for(retry_after_max_s: float) -> float:
    """How long a first attempt waits for its retry: `WINDOW_S`, or the longest Retry-After
    told plus `WINDOW_SLACK_S` where that is longer."""
    return max(WINDOW_S, retry_after_max_s + WINDOW_SLACK_S)


class RetryMatch:
    """Per (class, tenant, caller): how many first attempts this processor turned away that no
    admitted retry has matched yet, until `window_s` after the last of them."""

    def __init__(self, window_s: float = WINDOW_S, max_keys: int = MAX_KEYS) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._open: OrderedDict[tuple[int, str, str], tuple[int, float]] = OrderedDict()  # key -> (count, until)

    def turned_away(self, cls: int, tenant: str, now: float, caller: str = "") -> None:
        """A first attempt (not a retry) was turned away and counted as demand."""
        key = (cls, tenant, caller)
        n, until = self._open.pop(key, (0, 0.0))
        if until <= now:
            n = 0
        self._open[key] = (min(MAX_PER_KEY, n + 1), now + self.window_s)
        while len(self._open) > self.max_keys:
            self._open.popitem(last=False)

    def admitted_retry(self, cls: int, tenant: str, now: float, caller: str = "") -> bool:
        """A retry was admitted: True when it matches an unmatched first attempt (taken)."""
        key = (cls, tenant, caller)
        got = self._open.get(key)
        if got is None:
            return False
        n, until = got
        if until <= now or n <= 0:
            del self._open[key]
            return False
        if n == 1:
            del self._open[key]
        else:
            self._open[key] = (n - 1, until)
        return True

    def __len__(self) -> int:
        return len(self._open)
