"""Pure continuous-batching model of a vLLM engine: no I/O, no clock, deterministic.

The async shell (`sim.emulator`) owns the clock and calls `Engine.advance(now)`; tests call it
with a fake clock. The model follows the vLLM v1 scheduler closely enough for the signals an
admission controller and an autoscaler read:

* At most `max_num_seqs` sequences run per step; the rest wait in a FIFO queue, or, with
  `scheduling_policy="priority"` (vLLM's `--scheduling-policy priority`), in order of
  (priority, arrival): a lower value goes first. vLLM rejects a non-zero `priority` under its
  default `fcfs` policy ("Got priority N but Priority scheduling is not enabled."), and so does
  this model (`PriorityNotEnabled`).
* KV cache: `num_kv_blocks` blocks of `block_size` tokens. A sequence holds
  ceil(computed tokens / block_size) blocks (prompt and generated tokens). A request is
  admitted only if its blocks fit; a running sequence that needs a new block when the cache is
  full preempts the most recently admitted running sequence (recompute preemption: its blocks
  are freed and it goes back to the head of the queue, to be prefilled again); under the
  priority policy it preempts the running sequence with the largest (priority, arrival) instead,
  which goes back into the queue in its (priority, arrival) place (vLLM v1's scheduler: a
  waiting request never preempts a running one; only a running one that needs blocks does).
* Chunked prefill: each step computes at most `max_num_batched_tokens` tokens; decodes (one
  token each) are scheduled first, prompt chunks fill the rest of the budget.
* Step duration = decode_base_s + decode_per_seq_s * (decoding sequences)
  + prefill_per_token_s * (prefill tokens). Every sequence whose prompt is fully computed at
  the end of a step samples one token, stamped with the step's end time.

So TTFT grows with the queue ahead of a request and with prefill work, and TPOT grows with the
running batch size.

Sleep mode mirrors vLLM: level 1 offloads weights (fast wake), level 2 discards them (slow
wake); both drop the KV cache, so sleeping requires an idle engine (`mode="wait"` drains
in-flight work first, `mode="abort"` aborts it).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field, replace


class EngineError(Exception):
    """Base class for requests the engine refuses."""


class EngineNotAwake(EngineError):
    """The engine is asleep, falling asleep or waking up: it takes no new requests."""


class RequestTooLong(EngineError):
    """Prompt plus output can never fit the context window or the KV cache."""


class PriorityNotEnabled(EngineError):
    """A non-zero priority under the fcfs policy (vLLM answers 400 with this message)."""


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class EngineConfig:
    """Timing and capacity of the emulated model server.

    Defaults resemble a 7-8B model in bf16 on one modern 80 GB GPU.
    """

    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int = 6250  # 100k tokens of KV cache
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768
    prefill_per_token_s: float = 0.00012
    decode_base_s: float = 0.020
    decode_per_seq_s: float = 0.00015
    wake_level1_s: float = 1.0  # copy offloaded weights back to the GPU
    wake_level2_s: float = 8.0  # reallocate and reload weights
    sleep_s: float = 0.5  # offload weights / free memory when falling asleep
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs | priority

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        for name in ("max_num_seqs", "block_size", "num_kv_blocks", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("prefill_per_token_s", "decode_base_s", "decode_per_seq_s",
                     "wake_level1_s", "wake_level2_s", "sleep_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def scaled(self, factor: float) -> EngineConfig:
        """The same model running `1/factor` times faster (factor < 1) or slower."""
        if factor <= 0:
            raise ValueError("time scale must be > 0")
        return replace(
            self,
            prefill_per_token_s=self.prefill_per_token_s * factor,
            decode_base_s=self.decode_base_s * factor,
            decode_per_seq_s=self.decode_per_seq_s * factor,
            wake_level1_s=self.wake_level1_s * factor,
            wake_level2_s=self.wake_level2_s * factor,
            sleep_s=self.sleep_s * factor,
        )


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class SleepState(enum.Enum):
    """Values of the `sleep_state` label of `vllm:engine_sleep_state`, plus transitions."""

    AWAKE = "awake"
    DRAINING = "draining"  # sleep(mode=wait) requested, in-flight requests finishing
    ASLEEP = "asleep"
    WAKING = "waking"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_tokens: int
    output_tokens: int  # tokens to generate before finishing
    arrival: float
    finish_reason: str = "length"  # reported when the sequence completes
    state: SeqState = SeqState.WAITING
    generated: int = 0
    num_computed: int = 0  # tokens whose KV is in the cache
    blocks: int = 0
    scheduled_at: float | None = None  # first admission (end of queueing)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    num_preemptions: int = 0
    admit_order: int = 0
    priority: int = 0  # vLLM's request priority: lower is scheduled first (priority policy)
    arrival_order: int = 0  # ties of (priority, arrival) keep the order of add_request

    @property
    def queue_key(self) -> tuple[int, float, int]:
        return self.priority, self.arrival, self.arrival_order

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One sampled token. `finished` is set on the sequence's last token."""

    seq: Sequence
    time: float
    index: int  # 0-based position in the output
    finished: bool
    gap: float | None  # seconds since the previous token (inter-token latency); None on the first


class TokenTimes:
    """Per request, from an engine's token events: the first and last token's time and how many
    tokens it has produced (what TTFT, TPOT and goodput are read from)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def record(self, ev: TokenEvent) -> None:
        rid = ev.seq.request_id
        self.first.setdefault(rid, ev.time)
        self.last[rid] = ev.time
        self.count[rid] = ev.index + 1

    def tpot(self, rid: str) -> float:
        """Mean seconds per output token after the first (0 with one token)."""
        n = self.count[rid]
        return (self.last[rid] - self.first[rid]) / (n - 1) if n > 1 else 0.0


@dataclass
class _Step:
    start: float
    end: float
    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)


@dataclass
class EngineStats:
    """Cumulative counters (monotonic) for the metrics endpoint."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.free_blocks = self.config.num_kv_blocks
        self.stats = EngineStats()
        self.sleep_state = SleepState.AWAKE
        self.sleep_level = 0
        self._pending_sleep_level = 0
        self._wake_at = 0.0
        self._step: _Step | None = None
        self._last_end = -math.inf  # the engine is busy until the current step ends
        self._admit_counter = 0
        self._arrival_counter = 0

    @property
    def priority_policy(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue in (priority, arrival) order (priority policy)."""
        key = seq.queue_key
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].queue_key > key:
            i -= 1
        self.waiting.insert(i, seq)
    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_tokens: int, output_tokens: int, now: float,
                    finish_reason: str = "length", priority: int = 0) -> Sequence:
        if priority != 0 and not self.priority_policy:
            raise PriorityNotEnabled(f"Got priority {priority} but Priority scheduling is not enabled.")
        if self.sleep_state is not SleepState.AWAKE:
            raise EngineNotAwake(f"engine is {self.sleep_state.value}")
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_tokens = max(1, prompt_tokens)
        output_tokens = max(1, output_tokens)
        total = prompt_tokens + output_tokens
        if total > self.config.max_model_len:
            raise RequestTooLong(
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {total} tokens ({prompt_tokens} in the messages, "
                f"{output_tokens} in the completion)."
            )
        if total > self.config.kv_capacity_tokens:
            raise RequestTooLong(
                f"request needs {total} tokens of KV cache but the cache holds "
                f"{self.config.kv_capacity_tokens}"
            )
        self._arrival_counter += 1
        seq = Sequence(request_id, prompt_tokens, output_tokens, now, finish_reason, priority=priority,
                       arrival_order=self._arrival_counter)
        self.seqs[request_id] = seq
        if self.priority_policy:
            self._enqueue(seq)
        else:
            self.waiting.append(seq)
        return seq

    def abort(self, request_id: str, now: float) -> Sequence | None:
        """Drop a request (client gone, or sleep with mode=abort); frees its KV blocks."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        self._free(seq)
        seq.state = SeqState.ABORTED
        seq.finished_at = now
        seq.finish_reason = "abort"
        self.stats.finished["abort"] = self.stats.finished.get("abort", 0) + 1
        return seq

    # ---- sleep mode -----------------------------------------------------------------------

    def sleep(self, level: int, mode: str, now: float) -> list[Sequence]:
        """Start falling asleep; returns the sequences aborted (mode="abort").

        With mode="wait" the engine stops admitting new requests and falls asleep once the
        in-flight ones finish (`advance` completes the transition).
        """
        if level not in (1, 2):
            raise ValueError("level must be 1 or 2")
        if mode not in ("wait", "abort"):
            raise ValueError("mode must be 'wait' or 'abort'")
        if self.sleep_state is SleepState.ASLEEP:
            # vLLM allows a deeper sleep while asleep; a shallower request keeps the deeper one.
            self.sleep_level = max(self.sleep_level, level)
            return []
        if self.sleep_state is SleepState.WAKING:
            # Sleeping again mid-wake: weights are not (all) back, so it is simply asleep.
            self.sleep_state = SleepState.ASLEEP
            self.sleep_level = max(self.sleep_level, level)
            return []
        aborted: list[Sequence] = []
        if mode == "abort":
            for rid in [s.request_id for s in (*self.running, *self.waiting)]:
                seq = self.abort(rid, now)
                if seq is not None:
                    aborted.append(seq)
        self._pending_sleep_level = max(level, self._pending_sleep_level)
        self.sleep_state = SleepState.DRAINING
        self._maybe_fall_asleep()
        return aborted

    def wake_up(self, now: float) -> float:
        """Start waking; returns the time at which the engine takes requests again."""
        if self.sleep_state is SleepState.AWAKE:
            return now
        if self.sleep_state is SleepState.DRAINING:
            # Cancelled before it slept: nothing was offloaded.
            self.sleep_state = SleepState.AWAKE
            self._pending_sleep_level = 0
            return now
        if self.sleep_state is SleepState.ASLEEP:
            delay = self.config.wake_level2_s if self.sleep_level >= 2 else self.config.wake_level1_s
            self._wake_at = now + delay
            self.sleep_state = SleepState.WAKING
        self._maybe_finish_waking(now)
        return self._wake_at if self.sleep_state is SleepState.WAKING else now

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_state in (SleepState.ASLEEP, SleepState.WAKING)

    def _maybe_fall_asleep(self) -> None:
        if self.sleep_state is SleepState.DRAINING and not self.running and not self.waiting:
            self.sleep_state = SleepState.ASLEEP
            self.sleep_level = self._pending_sleep_level
            self._pending_sleep_level = 0

    def _maybe_finish_waking(self, now: float) -> None:
        if self.sleep_state is SleepState.WAKING and now >= self._wake_at:
            self.sleep_state = SleepState.AWAKE
            self.sleep_level = 0

    # ---- stepping -------------------------------------------------------------------------

    @property
    def step_in_flight(self) -> bool:
        return self._step is not None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._step)

    def next_event_time(self) -> float | None:
        """When `advance` next has something to do, or None if only new input can matter."""
        if self._step is not None:
            return self._step.end
        if self.sleep_state is SleepState.WAKING:
            return self._wake_at
        if self.sleep_state is SleepState.ASLEEP:
            return None
        if self.running:
            return self._last_end
        if self.waiting:
            return max(self._last_end, self._first_arrival())
        return None

    def _first_arrival(self) -> float:
        # FIFO: the head arrived first; by priority, any waiter may have.
        return min(s.arrival for s in self.waiting) if self.priority_policy else self.waiting[0].arrival

    def advance(self, now: float) -> list[TokenEvent]:
        """Run every step that completes by `now`; start the step in progress at `now`.

        Steps start back to back while there is work; an idle engine starts its next step at
        the arrival of the first waiting request, so results do not depend on how often this
        is called.
        """
        events: list[TokenEvent] = []
        self._maybe_finish_waking(now)
        while True:
            if self._step is not None:
                if self._step.end > now:
                    break
                end = self._step.end
                events.extend(self._finish_step(self._step))
                self._step = None
                self._last_end = end
                self._maybe_fall_asleep()
            start = self._next_start(now)
            if start is None:
                break
            self._step = self._schedule(start)
            if self._step is None:
                break
        return events

    def _next_start(self, now: float) -> float | None:
        if self.sleep_state in (SleepState.ASLEEP, SleepState.WAKING):
            return None
        if self.running:
            return self._last_end  # back to back with the previous step
        if not self.waiting:
            return None
        start = max(self._last_end, self._first_arrival())
        return start if start <= now else None

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _free(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _allocate(self, seq: Sequence, tokens: int) -> bool:
        need = self._blocks_for(seq.num_computed + tokens) - seq.blocks
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        seq.blocks += need
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0  # recompute: prompt and generated tokens are prefilled again
        seq.state = SeqState.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        if self.priority_policy:
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)

    def _schedule(self, start: float) -> _Step | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        # Running sequences first, oldest admission first; preempt the newest on a full cache.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._allocate(seq, n):
                if self.priority_policy:
                    victim = max(self.running, key=lambda s: (s.priority, s.arrival, s.arrival_order))
                    k = self.running.index(victim)
                    if k < i:  # already scheduled in this step: give its tokens back
                        j = next(j for j, (s, _) in enumerate(scheduled) if s is victim)
                        budget += scheduled.pop(j)[1]
                        i -= 1
                else:
                    victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            # `seq` preempted itself: every later sequence is gone too.
            break
        # Then admit from the queue, FIFO (or by priority), unless this step had to preempt (vLLM
        # does the same) and still runs something.
        while ((not preempted or not scheduled) and self.waiting and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            if self.priority_policy:
                head = next((k for k, s in enumerate(self.waiting) if s.arrival <= start), None)
            else:
                head = 0 if self.waiting[0].arrival <= start else None
            if head is None:
                break
            seq = self.waiting[head]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._allocate(seq, n):
                break  # head of line blocks, like vLLM (both policies)
            del self.waiting[head]
            seq.state = SeqState.RUNNING
            self._admit_counter += 1
            seq.admit_order = self._admit_counter
            if seq.scheduled_at is None:
                seq.scheduled_at = start
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        if not scheduled:
            return None
        decode_seqs = 0
        prefill_tokens = 0
        for seq, n in scheduled:
            if n == 1 and seq.num_computed >= seq.prompt_tokens:
                decode_seqs += 1
            else:
                prefill_tokens += n
        duration = (cfg.decode_base_s + cfg.decode_per_seq_s * decode_seqs
                    + cfg.prefill_per_token_s * prefill_tokens)
        self.stats.steps += 1
        return _Step(start, start + duration, scheduled)

    def _finish_step(self, step: _Step) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        t = step.end
        for seq, n in step.scheduled:
            if seq.state is not SeqState.RUNNING:
                continue  # aborted or preempted while the step ran
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk: no token sampled yet
            index = seq.generated
            seq.generated += 1
            self.stats.generation_tokens += 1
            gap = None if seq.last_token_at is None else t - seq.last_token_at
            if seq.first_token_at is None:
                seq.first_token_at = t
                self.stats.prompt_tokens += seq.prompt_tokens  # once, even if recomputed
            seq.last_token_at = t
            done = seq.generated >= seq.output_tokens
            if done:
                self.running.remove(seq)
                self._free(seq)
                seq.state = SeqState.FINISHED
                seq.finished_at = t
                self.seqs.pop(seq.request_id, None)
                reason = seq.finish_reason
                self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            events.append(TokenEvent(seq, t, index, done, gap))
        return events

    # ---- gauges ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.free_blocks / self.config.num_kv_blocks
