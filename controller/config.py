"""Controller configuration: one YAML file, validated by pydantic, with env overrides.

A bad file stops start-up with a message naming the field (`pools.0.policy.min_replicas: ...`).
Env overrides win over the file: FLOODGATE_REDIS_URL, FLOODGATE_REDIS_PASSWORD,
FLOODGATE_CONTROLLER_METRICS_LISTEN, FLOODGATE_ENVOY_ADMIN_URL.

    redis: {url: redis://127.0.0.1:6379/0}
    tick_interval_s: 1.0
    metrics_listen: 127.0.0.1:9465
    envoy: {admin_url: http://127.0.0.1:9901}
    pools:
      - name: default
        policy: {min_replicas: 1, max_replicas: 8}
        warm_pool: {min_size: 1}
        actuator:
          kind: process
          command: [floodgate, sim, --port, "{port}", --enable-sleep-mode]
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from floodgate.controller.capacity import CapacityConfig
from floodgate.controller.demand import DemandConfig
from floodgate.controller.forecast import ForecastConfig
from floodgate.controller.lifecycle import WarmPoolConfig
from floodgate.controller.policy import PolicyConfig
from floodgate.extproc.config import PoolName
from floodgate.extproc.schema import controller_leader_key
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from floodgate.validators import OptionalHttpURL, OptionalListenAddress, RedisURL, check_listen
from floodgate.yamlconfig import STRICT, ConfigError, format_errors, name_env_sources, read_mapping

__all__ = ["ConfigError", "ControllerConfig", "check_commands", "check_state_dirs", "load_config", "parse_config", "process_state_dir", "table_owner"]


class _Strict(BaseModel):
    model_config = STRICT


class RedisConfig(_Strict):
    url: RedisURL = Field(default="redis://127.0.0.1:6379/0", description="Redis holding Floodgate's shared state: redis://, rediss:// (TLS), unix://, redis+sentinel://h1:26379,h2:26379/service or redis+cluster://h1:6379,h2:6379 (see docs/operations.md); password in the URL or below.")
    password: str | None = Field(default=None, description="Redis password (or in the URL).")
    op_timeout_s: float = Field(default=1.0, gt=0, le=30, description="Per-call timeout; a dead Redis must not stall a tick.")


class EnvoyConfig(_Strict):
    admin_url: OptionalHttpURL = Field(default=None, description="Envoy admin base URL (http:// or https://); unset: no Envoy signals.")
    clusters: list[str] | None = Field(default=None, min_length=1, description="Upstream clusters to sum: list the ones routes reach the models through. Unset: all but floodgate_*, including one that proxies this very stats scrape (compose's envoy_admin: one active request per scrape). An empty list would sum none.")
    gateway_stat_prefix: str | None = Field(default="gateway", description="stat_prefix of the gateway's HTTP connection manager: its ext_proc streams started (the requests that reached admission; downstream_rq_total where it has no ext_proc stats) and ext_proc immediate responses are the offered-demand cross-check; null: not read.")


class LeaderConfig(_Strict):
    enabled: bool = Field(default=True, description="Act only while holding the Redis leader lease.")
    key: str = Field(default=controller_leader_key(), min_length=1, description="Redis key of the lease.")
    ttl_s: float = Field(default=10.0, ge=1, le=600, description="Lease lifetime; a standby takes over this long after a crash. At least 3 x `redis.op_timeout_s`: renewed every third of it, a renewal slower than a third lets leadership lapse until the next.")


class ActuatorConfig(_Strict):
    kind: Literal["process", "static", "kubernetes", "endpointslices"] = Field(
        description="Where replicas run. `endpointslices`: metrics-only (KEDA/HPA owns the replica count); "
        "pods are discovered from the model Service's EndpointSlices, never created or deleted.")
    command: list[str] | None = Field(default=None, description="process: argv template: `{port}` (required), `{replica_id}` and `{host}` are replaced, every other character (JSON arguments included) is passed as written; default `floodgate sim` with sleep mode.")
    state_dir: str | None = Field(default=None, description="process: where the replica table and logs live (the logs of the 32 replicas stopped last are kept; default: <tmp>/floodgate-controller-<pool>-<hash of the Redis hosts, leader key and pool>). A table of another deployment whose replicas still run is refused.")
    env: dict[str, str] = Field(default_factory=dict, description="process: extra environment for replicas.")
    endpoints: dict[str, str] | list[str] | None = Field(default=None, description="static: endpoints (host:port, each once), or name -> endpoint.")
    options: dict[str, Any] = Field(default_factory=dict, description="kubernetes: keyword arguments of the Kubernetes actuator; endpointslices: namespace, service, port_name, in_cluster, ... (controller/discovery.py).")

    @model_validator(mode="after")
    def _kind_fields(self) -> ActuatorConfig:
        # A field the kind does not read would be silently ignored: an error instead.
        stray = [f"{name} (read by kind {' or '.join(kinds)} only)" for name, kinds in _KIND_FIELDS.items()
                 if self.kind not in kinds and name in self.model_fields_set and getattr(self, name)]
        if stray:
            raise ValueError(f"kind {self.kind!r} would ignore {', '.join(stray)}: remove it or change the kind")
        if self.kind == "static" and not self.endpoints:
            raise ValueError("static actuator needs endpoints")
        if self.kind == "static" and self.endpoints:
            _check_endpoints(self.endpoints)
        if self.command is not None and not any("{port}" in a for a in self.command):
            raise ValueError("command needs a {port} placeholder")
        for i, a in enumerate(self.command or ()):
            if "{{" in a:
                # Braces were once doubled to pass through str.format; now every brace but the
                # three placeholders is passed as written, so `{{` would reach the model server
                # (no valid JSON has it: an object cannot open with an object).
                raise ValueError(f"command[{i}] {a!r} has '{{{{': only {{port}}, {{replica_id}} and {{host}} are "
                                 "replaced and every other brace is passed as written (write JSON with single braces)")
        if self.kind == "kubernetes":
            from floodgate.controller.actuators.kubernetes import KubernetesActuatorConfig

            _nested(KubernetesActuatorConfig, self.options)
            _needs_kubernetes_client(self.kind)
        if self.kind == "endpointslices":
            from floodgate.controller.discovery import EndpointSliceConfig

            _nested(EndpointSliceConfig, self.options)
            _needs_kubernetes_client(self.kind)
        return self


# The actuator fields only some kinds read (`kind` itself aside).
_KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "command": ("process",), "state_dir": ("process",), "env": ("process",),
    "endpoints": ("static",), "options": ("kubernetes", "endpointslices"),
}


def _check_endpoints(endpoints: Mapping[str, str] | list[str]) -> None:
    """Static endpoints: each HOST:PORT (the controller calls `http://HOST:PORT/...`), each once."""
    items = list(endpoints.items()) if isinstance(endpoints, Mapping) else [(str(i), ep) for i, ep in enumerate(endpoints)]
    problems: list[str] = []
    first: dict[str, str] = {}
    for name, ep in items:
        try:
            if "/" in ep:
                raise ValueError("no scheme or path")
            check_listen(ep)
        except ValueError as exc:
            why = "" if "is not HOST:PORT" in str(exc) else f": {exc}"
            problems.append(f"endpoints.{name}: {ep!r} is not HOST:PORT (e.g. 10.0.0.5:8000){why}")
            continue
        if ep in first:
            problems.append(f"endpoints.{name}: {ep} is also endpoints.{first[ep]} (each endpoint once)")
        first.setdefault(ep, name)
    if problems:
        raise ValueError("; ".join(problems))


def _nested(model: type[BaseModel], options: Mapping[str, Any]) -> None:
    """Validate `options` as `model`, naming the nested field (`options.port: ...`)."""
    try:
        model.model_validate(options)
    except ValidationError as exc:
        raise ValueError("; ".join(
            f"options.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())) from None


def _needs_kubernetes_client(kind: str) -> None:
    # Checked here (at --check-config and start), not at the first leader tick.
    import importlib.util

    if importlib.util.find_spec("kubernetes_asyncio") is None:
        raise ValueError(f"kind {kind!r} needs the Kubernetes client: pip install 'floodgate[k8s]'")


class TimeoutsConfig(_Strict):
    health_s: float = Field(default=600.0, gt=0, description="Cold start: longest wait for /health (model load).")
    health_poll_s: float = Field(default=0.25, gt=0, le=10, description="Cold start: longest pause between two "
                                 "/health polls (backs off from 0.1 s): how late a loaded replica is noticed. From a "
                                 "second before the shortest cold start this controller measured to a second after the "
                                 "longest, it polls every 0.05 s.")
    warmup_s: float = Field(default=60.0, gt=0, description="Longest one-token warm-up request.")
    wake_s: float = Field(default=120.0, gt=0, description="Longest POST /wake_up.")
    sleep_s: float = Field(default=600.0, gt=0, description="Longest POST /sleep (mode=wait).")
    scrape_s: float = Field(default=1.0, gt=0, description="Per-scrape timeout.")
    adopt_grace_s: float = Field(default=30.0, ge=0, description="A started replica may be missing from the actuator's list this long.")
    unresponsive_s: float = Field(default=30.0, ge=0, description="An active replica whose scrapes have all failed this long, and whose /health then does not answer either, is marked failed: taken out of the registry and replaced like a crashed one (a hung process, a frozen node). A replica that answers /health is kept, whatever its /metrics do. 0: never.")
    pool_probe_s: float = Field(default=10.0, ge=0, description="How often each warm-pool replica (awake or asleep: it serves nothing and is not scraped) gets a /health check of its own, beside the ticks, with the `liveness_probe_s` timeout. One whose checks have all failed for `unresponsive_s` is marked failed and replaced like a crashed one, so a hung pool replica is found while it waits, not when a burst promotes it. 0: never.")
    liveness_probe_s: float = Field(default=10.0, gt=0, description="How long the /health check of a replica whose scrapes have failed for `unresponsive_s` may take before it counts as not answering (its own timeout, not `scrape_s`: an overloaded replica answers slowly but still serves). It runs beside the ticks, never inside one.")
    start_backoff_s: float = Field(default=1.0, gt=0, description="After a replica's start or bring-up fails, the next start waits this long, doubling with each failure in a row up to `start_backoff_max_s`; a replica that has served for `crash_loop_s` resets it (a missing binary or a crashing command otherwise restarts as fast as the ticks run). After a failure, starts go one at a time until a replica comes up.")
    crash_loop_s: float = Field(default=60.0, ge=0, description="A replica that fails within this long after it came up (its warm-up passed: it crashed on its first batches, an OOM, a bad kernel, a node that kills it) counts as a failed start for `start_backoff_s`, and the backoff resets only once a replica has served this long: such a replica otherwise restarted as fast as it died, one model load after another (a review: 16 cold starts in 40 s, no backoff). 0: only failures before coming up count.")
    start_backoff_max_s: float = Field(default=60.0, gt=0, description="The longest wait between failing starts.")

    @model_validator(mode="after")
    def _backoff(self) -> TimeoutsConfig:
        if self.start_backoff_s > self.start_backoff_max_s:
            raise ValueError(f"start_backoff_s ({self.start_backoff_s:g}) must be ≤ start_backoff_max_s "
                             f"({self.start_backoff_max_s:g}): the first wait would be cut to the cap")
        return self


class AdmissionCeilingConfig(_Strict):
    enabled: bool = Field(default=True, description="While the pool waits for cold starts (more replicas decided than are active or waking) and the active replicas are offered more than the ceiling lets them hold (on; off again once demand is within what they carry), publish an admission ceiling for its processors: the per-replica capacity the pool is sized with (learned, else `policy.target_concurrency`) x `headroom`, per active endpoint. Processors with `limit.controller_ceiling` (on by default) hold their Vegas limit at or below it x the active endpoints, so the part of a burst the active replicas cannot start waits in Floodgate's priority queue (or is turned away, which counts as demand), not in the engines' FIFO queues, until the cold-started replicas serve; a promotion from the warm pool (serving within a wake) does not publish it (docs/controller.md, \"Admission ceiling\").")
    headroom: float = Field(default=1.5, ge=1.0, le=10.0, description="Ceiling per active endpoint as a multiple of the per-replica capacity: room above the sizing target for uneven picking and requests between slots.")
    ttl_s: float = Field(default=10.0, gt=0, le=600, description="Lifetime of the published ceiling (and of the announcement of capacity on its way): a controller that stops (or loses leadership) stops capping this long after its last tick.")
    announce_arrivals: bool = Field(default=True, description="Announce the capacity on its way to the processors every tick: the replicas the plan still needs that are cold-starting or waking, each due at the time this controller measured such a start to take (the longest of the last three cold starts, wakes from sleep, promotions of awake replicas; nothing before one was measured). Processors with `limit.controller_arrivals` let a request wait for the permits due before its queue timeout instead of turning it away (docs/controller.md, \"Capacity on its way\").")


class PoolConfig(_Strict):
    name: PoolName = Field(description="Pool name, as in the processor config (the same rule: letters, digits, "
                           "`_`, `.` and `-`).")
    model: str | None = Field(default=None, description="Model name for warm-up requests; unset: the replica's first /v1/models entry.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    forecast: ForecastConfig = Field(default_factory=ForecastConfig)
    warm_pool: WarmPoolConfig = Field(default_factory=WarmPoolConfig)
    demand: DemandConfig = Field(default_factory=DemandConfig)
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    admission_ceiling: AdmissionCeilingConfig = Field(default_factory=AdmissionCeilingConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    actuator: ActuatorConfig = Field(description="Where the replicas run (required: a forgotten section would otherwise start emulated `floodgate sim` replicas). `kind: process` with no `command` runs the emulator, for local tries.")
    id_prefix: str | None = Field(default=None, description="Prefix of new replica ids (default: `<pool>-r`).")

    @model_validator(mode="after")
    def _consistent(self) -> PoolConfig:
        """Sections that contradict each other: the controller would never reach what they ask
        (it would sit at desired > active, or ignore a setting), so stop at start instead."""
        pol, wp, problems = self.policy, self.warm_pool, []
        if pol.min_replicas > wp.max_total:
            problems.append(f"policy.min_replicas ({pol.min_replicas}) is above warm_pool.max_total ({wp.max_total}): "
                            "the pool could never start its minimum")
        if wp.enabled and wp.min_size > pol.max_replicas:
            problems.append(f"warm_pool.min_size ({wp.min_size}) is above policy.max_replicas ({pol.max_replicas}): "
                            "the warm pool never exceeds max_replicas minus the desired count")
        if self.actuator.kind == "static" and self.actuator.endpoints and pol.min_replicas > len(self.actuator.endpoints):
            problems.append(f"policy.min_replicas ({pol.min_replicas}) is above the {len(self.actuator.endpoints)} "
                            "static actuator.endpoints: the pool could never reach its minimum")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ControllerConfig(_Strict):
    redis: RedisConfig = Field(default_factory=RedisConfig)
    envoy: EnvoyConfig = Field(default_factory=EnvoyConfig)
    leader: LeaderConfig = Field(default_factory=LeaderConfig)
    tick_interval_s: float = Field(default=1.0, gt=0, le=60, description="Seconds between ticks.")
    metrics_listen: OptionalListenAddress = Field(default="127.0.0.1:9465", description="HOST:PORT of /metrics (IPv6 in brackets); null: none. The default port is one above the processor's (9464), so both run on one host with their defaults.")
    pools: list[PoolConfig] = Field(min_length=1, description="The pools this controller scales.")

    @model_validator(mode="after")
    def _lease_outlives_a_call(self) -> ControllerConfig:
        # The holder counts itself leader until a third of the TTL before its last renewal's
        # lease ends, renewing every third: a call that may take more than a third of the TTL
        # (the per-call timeout) lets leadership lapse between renewals that all succeed, while
        # Redis still names it (no standby takes over either: a review, leader 20 % of the time).
        if self.leader.enabled and self.redis.op_timeout_s * 3 > self.leader.ttl_s:
            raise ValueError(f"leader.ttl_s ({self.leader.ttl_s:g}) must be at least 3 x redis.op_timeout_s "
                             f"({self.redis.op_timeout_s:g}): a lease renewal may take up to the per-call timeout")
        return self

    @field_validator("pools")
    @classmethod
    def _unique(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        # A static endpoint in two pools: one pool slept or drained it under the other, whose
        # registry still listed it active (an operator review: 503 "The model is sleeping").
        owner: dict[str, str] = {}
        for p in pools:
            eps = p.actuator.endpoints or ()
            for ep in set(eps.values() if isinstance(eps, Mapping) else eps):
                if ep in owner:
                    raise ValueError(f"pool {p.name!r}: actuator.endpoints {ep} is also pool {owner[ep]!r}'s "
                                     "(a replica serves one pool: each static endpoint in one pool only)")
                owner[ep] = p.name
        return pools


ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "FLOODGATE_REDIS_URL": ("redis", "url"),
    "FLOODGATE_REDIS_PASSWORD": ("redis", "password"),
    "FLOODGATE_CONTROLLER_METRICS_LISTEN": ("metrics_listen",),
    "FLOODGATE_ENVOY_ADMIN_URL": ("envoy", "admin_url"),
}


def parse_config(raw: dict[str, Any], env: Mapping[str, str] | None = None) -> ControllerConfig:
    raw = dict(raw)
    environ: Mapping[str, str] = os.environ if env is None else env
    from_env: dict[tuple[str, ...], str] = {}
    for var, where in ENV_OVERRIDES.items():
        if environ.get(var):
            node = raw
            for key in where[:-1]:
                node[key] = dict(node.get(key) or {})
                node = node[key]
            node[where[-1]] = environ[var]
            from_env[where] = var
    try:
        return ControllerConfig.model_validate(raw)
    except ValidationError as exc:
        # An error in a value the environment set names the variable, as the processor's do.
        raise ConfigError(name_env_sources(format_errors(exc, "invalid controller config"), from_env)) from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> ControllerConfig:
    return parse_config(read_mapping(path), env)


def table_owner(cfg: ControllerConfig, pool: PoolConfig) -> str:
    """Who a process actuator's replica table belongs to: the Redis the replicas are registered
    in (its hosts and path, without credentials or options: `process.redis_deployment`), the
    leader key and the pool. Two controllers of one deployment (a leader and its standby) agree
    on it; two unrelated stacks on one host do not."""
    from floodgate.controller.actuators.process import redis_deployment

    return f"redis {redis_deployment(cfg.redis.url)} leader {cfg.leader.key} pool {pool.name}"


def _legacy_table_owner(cfg: ControllerConfig, pool: PoolConfig) -> str:
    """`table_owner` as versions before `redis_deployment` wrote it (the URL with its user and a
    masked password, and its options): where their default state_dir was."""
    from floodgate.extproc.redis_client import redact_url

    return f"redis {redact_url(cfg.redis.url, mask_user_only=True)} leader {cfg.leader.key} pool {pool.name}"


def _default_state_dir(pool: PoolConfig, owner: str) -> Path:
    tag = hashlib.sha256(owner.encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"floodgate-controller-{pool.name}-{tag}"


def process_state_dir(cfg: ControllerConfig, pool: PoolConfig) -> Path:
    """The directory a `process` actuator keeps its replica table in (`app.build_actuator` and the
    start-up check use this one rule). The default is per owner (`table_owner`), so unrelated
    stacks on one host never share a table; the directory an earlier version's default gave
    this config is used while it holds the table and the new one holds none (an upgrade)."""
    a = pool.actuator
    if a.state_dir:
        return Path(a.state_dir)
    new = _default_state_dir(pool, table_owner(cfg, pool))
    old = _default_state_dir(pool, _legacy_table_owner(cfg, pool))
    if old != new and not (new / "replicas.json").exists() and (old / "replicas.json").exists():
        return old
    return new


def check_state_dirs(cfg: ControllerConfig, *, create: bool) -> None:
    """Every `process` actuator's state_dir must be (or become) a writable directory, and must
    not hold the running replicas of another deployment: else the actuator would fail at
    start-up with a traceback, or adopt (and drain, and stop) a stranger's replicas. With
    `create` the missing directories are made and kept (start-up); without (`--check-config`)
    they are made and removed again."""
    from floodgate.controller.actuators.process import TableOwnedElsewhere, check_owner

    problems = []
    for i, pool in enumerate(cfg.pools):
        if pool.actuator.kind == "process":
            d = process_state_dir(cfg, pool)
            why = _probe_dir(d, keep=create)
            if why is None:
                try:
                    check_owner(d, table_owner(cfg, pool))
                except TableOwnedElsewhere as exc:
                    why = str(exc)
            if why:
                problems.append(f"  pools.{i}.actuator.state_dir: {why}")
    if problems:
        raise ConfigError("invalid controller config:\n" + "\n".join(problems))


def check_commands(cfg: ControllerConfig) -> None:
    """Every `process` actuator's command must name an executable this host can run (as found on
    the `PATH` its replicas get: `actuator.env`'s, else the controller's): else every start
    fails at run time, backing off for good (a review: the docs' own `command: [floodgate, sim,
    ...]` passed `--check-config` where `floodgate` was `.venv/bin/floodgate`, not on `PATH`)."""
    problems = []
    for i, pool in enumerate(cfg.pools):
        a = pool.actuator
        if a.kind != "process" or not a.command:
            continue
        exe = a.command[0]
        path = (a.env or {}).get("PATH", os.environ.get("PATH", os.defpath))
        if "/" in exe:
            ok = os.path.isfile(exe) and os.access(exe, os.X_OK)
        else:
            ok = shutil.which(exe, path=path) is not None
        if not ok:
            where = "not an executable file" if "/" in exe else "not found on PATH"
            problems.append(f"  pools.{i}.actuator.command: {exe!r} is {where} (give its full path, e.g. "
                            "/opt/floodgate/.venv/bin/floodgate)")
    if problems:
        raise ConfigError("invalid controller config:\n" + "\n".join(problems))


def _probe_dir(d: Path, *, keep: bool) -> str | None:
    missing = []
    p = d
    while not p.exists() and p.parent != p:
        missing.append(p)
        p = p.parent
    try:
        if d.exists() and not d.is_dir():
            return f"{d} is not a directory"
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot create {d}: {exc.strerror or exc}"
        if not os.access(d, os.W_OK | os.X_OK):
            return f"{d} is not writable"
        return None
    finally:
        if not keep:
            for m in missing:  # deepest first
                with contextlib.suppress(OSError):
                    m.rmdir()
