"""Scheduler and engine loop of one simulated engine (no HTTP here).

:class:`Scheduler` is pure bookkeeping: FCFS admission bounded by ``max_batch`` and by KV
blocks (reserved for prompt + output up front, no preemption; with ``enable_prefix_caching`` the
prompt's cached leading blocks are shared, not reserved again, and not computed again:
:mod:`sim.prefix`), then steps that each prefill a chunk of prompt tokens and decode one token for
every sequence past its prefill. With ``scheduling_policy`` ``priority``, vLLM v1's priority policy
(``vllm/v1/core/sched/scheduler.py``, 0.32.0): the waiting queue is ordered by (priority, arrival),
lower first; a sequence takes the KV blocks of its context at admission and one more whenever its next
token needs it; when none is free, the running sequence of the lowest priority (latest arrival among
equals) is preempted, possibly the one asking: its blocks are freed and it waits again, to recompute
its prompt and the tokens it generated (vLLM's recompute preemption) before its next token. As in vLLM
v1, nothing preempts a running sequence to admit a waiting one: a waiting sequence of higher priority
waits for a batch slot or blocks to free. ``priority-preempt`` adds what SGLang's priority scheduling
(``--enable-priority-scheduling``, ``SchedulePolicy.preempt_to_schedule``) and vLLM's removed V0
scheduler (``_schedule_priority_preemption``) do: a waiting sequence that finds no batch slot or blocks
preempts the running sequences of the lowest priority, one by one, while theirs is more than
:data:`PREEMPTION_THRESHOLD` worse. :class:`Engine`
runs it in an asyncio task, sleeping each step's modelled duration, pulling remote KV caches for
admitted sequences (falling back to a local prefill when a pull raises :class:`KvMissing`), holding
the KV blocks of finished prefills for remote decodes, and waking request handlers through
per-sequence events. All times are model seconds (:mod:`sim.clock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from sim.clock import SimClock
from sim.config import EngineConfig, KvConfig, TimingConfig
from sim.kv import NO_TRANSFER_RESULT, GroupMap, KvTransferModel, SharedLink, TransferResult, host_port
from sim.metrics import EngineMetrics
from sim.prefix import BlockCache, Holding, PromptBlocks

log = logging.getLogger(__name__)

WAITING, PULLING, RUNNING, FINISHED, ABORTED = "waiting", "pulling", "running", "finished", "aborted"
PREEMPTION_THRESHOLD = 10
"""``priority-preempt``: a waiting sequence preempts a running one whose priority is more than this
worse (SGLang's ``--priority-scheduling-preemption-threshold`` default)."""
Pull = Callable[[int], Awaitable[TransferResult]]
"""Load a sequence's KV cache from a remote prefill, given how many prompt tokens to load."""


class EngineError(RuntimeError):
    """A request failed inside the engine (KV pull error, engine stopped)."""


class KvMissing(Exception):
    """A pull's ``kv_transfer_params`` are unusable: the sequence is prefilled locally.

    Raised by a :data:`Pull` whose ``kv_transfer_params`` are unusable (vLLM: "Got invalid
    KVTransferParams ... will not utilize KVTransfer"): the engine prefills the sequence locally,
    whatever its ``kv_load_failure_policy``. The message says why."""


class KvLoadFailed(KvMissing):
    """A pull could not load the KV cache.

    Raised by a :data:`Pull` that could not load the KV cache (prefill unreachable, blocks not
    held, expired or freed): under ``kv_load_failure_policy`` ``fail`` the request fails with a
    :class:`KvLoadError`, under ``recompute`` it is prefilled locally."""


class KvLoadError(EngineError):
    """A request failed because its KV cache could not be loaded (policy ``fail``)."""


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep a finished prefill's KV blocks for a remote decode.

    Under ``key`` (the NIXL ``remote_request_id`` or the Mooncake ``transfer_id``) for ``seconds`` (model
    s) unless renewed."""

    key: str
    seconds: float


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. Token counts in tokens, times in model seconds.

    ``output_tokens`` (<= ``max_tokens``) is how many tokens it will generate; ``stops`` says the
    model ends by itself with the last of them (finish reason ``"stop"`` even when that token is
    also the last of the budget: vLLM checks for the end-of-sequence token before the length cap).
    ``pull`` loads its KV cache from a remote prefill (``None``: prefill locally): given the tokens
    to load, the prompt's tokens past ``cached_tokens``. ``prefix``: what the engine's prefix cache
    keys the request by (``None``: nothing is cached); ``cached_tokens``: the prompt tokens found
    cached at admission (not computed, not pulled); ``holding``: its KV blocks. ``hold`` keeps
    its KV blocks reserved after it finishes, as ``held_block_ids``, until :meth:`Engine.release_kv`
    or the hold's time runs out. ``cpu_tokens`` of the ``cached_tokens`` were found in the CPU KV tier
    (loaded, not computed; the first step it runs in pays the load, then it is ``cpu_loaded``).
    ``warning`` says why a pull fell back to a local prefill. ``ready`` is set once its KV cache is in
    place (or it failed); ``progress`` whenever it gains a token or ends. ``priority``: the body's
    (lower first, under the ``priority`` policy); ``resumed``: the output tokens it recomputes with
    its prompt after a preemption; ``preemptions``: how often it was preempted.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    arrival: float
    pull: Pull | None = None
    prefix: PromptBlocks | None = None
    stops: bool = False
    hold: Hold | None = None
    priority: int = 0
    resumed: int = 0
    preemptions: int = 0
    held_block_ids: tuple[int, ...] = ()
    warning: str | None = None
    state: str = WAITING
    prefilled: int = 0
    generated: int = 0
    kv_blocks: int = 0
    cached_tokens: int = 0
    cpu_tokens: int = 0
    cpu_loaded: bool = False
    holding: Holding = field(default_factory=Holding, repr=False)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    transfer: TransferResult = NO_TRANSFER_RESULT
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    progress: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def done(self) -> bool:
        """Finished or aborted."""
        return self.state in (FINISHED, ABORTED)

    @property
    def context_tokens(self) -> int:
        """Tokens it computes before its next output token: its prompt, plus ``resumed``."""
        return self.prompt_tokens + self.resumed

    @property
    def finish_reason(self) -> str | None:
        """Why the sequence finished (``stop`` or ``length``); ``None`` before.

        Once finished: ``"stop"`` when the model ended (``stops``, or before the budget ran
        out), else ``"length"``. ``None`` while running or when aborted."""
        if self.state != FINISHED:
            return None
        return "stop" if self.stops or self.generated < self.max_tokens else "length"


@dataclass
class StepPlan:
    """One scheduler step.

    ``prefill`` (sequence, prompt tokens this step), ``decode`` sequences, ``loads`` the sequences whose
    CPU-tier blocks it loads first (the step waits for the copy)."""

    prefill: list[tuple[Sequence, int]]
    decode: list[Sequence]
    duration_s: float
    loads: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Pure scheduler state; see the module docstring. Not thread-safe, no asyncio needed."""

    def __init__(self, timing: TimingConfig, kv: KvConfig | None = None) -> None:
        self.timing = timing
        self.kv = kv or KvConfig()
        self.waiting: deque[Sequence] = deque()
        self.pulling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.cache = BlockCache(timing.kv_capacity_blocks, timing.block_size, timing.cpu_kv_capacity_blocks)
        self.by_priority = timing.scheduling_policy != "fcfs"
        self.preempts_to_admit = timing.scheduling_policy == "priority-preempt"
        self.preemptions = 0

    @property
    def used_blocks(self) -> int:
        """KV blocks in use (free cached blocks, which any admission may evict, are not)."""
        return self.cache.used

    def blocks_for(self, seq: Sequence) -> int:
        """KV blocks reserved for ``seq``: prompt plus output tokens, rounded up to whole blocks."""
        return -(-(seq.prompt_tokens + seq.output_tokens) // self.timing.block_size)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; raise ``ValueError`` if it could never fit the KV cache."""
        if self.blocks_for(seq) > self.timing.kv_capacity_blocks:
            raise ValueError(
                f"request needs {seq.prompt_tokens + seq.output_tokens} KV tokens, "
                f"more than the cache holds ({self.timing.kv_capacity_blocks * self.timing.block_size})"
            )
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Put ``seq`` in the waiting queue: last (FCFS), or after those of its (priority, arrival)."""
        if not self.by_priority:
            self.waiting.append(seq)
            return
        key = (seq.priority, seq.arrival)
        index = len(self.waiting)
        while index and (self.waiting[index - 1].priority, self.waiting[index - 1].arrival) > key:
            index -= 1
        self.waiting.insert(index, seq)

    def _admission_blocks(self, seq: Sequence) -> int:
        """KV blocks ``seq`` takes at admission: prompt + output (FCFS), or its context (priority)."""
        if not self.by_priority:
            return self.blocks_for(seq)
        return -(-seq.context_tokens // self.timing.block_size)

    def admit(self, now: float) -> list[Sequence]:
        """Admit waiting sequences in queue order while batch slots and KV blocks last.

        Under ``priority-preempt``, a head that finds neither preempts running sequences
        (:meth:`_preempt_for`) until it fits, while they are of a priority low enough."""
        admitted: list[Sequence] = []
        cache = self.cache
        while self.waiting:
            seq = self.waiting[0]
            need = self._admission_blocks(seq)
            hashes = seq.prefix.hashes if seq.prefix is not None else ()
            hbm = cache.lookup(hashes, seq.prompt_tokens)
            hit = hashes[:hbm]
            loaded = hashes[hbm : hbm + cache.lookup_cpu(hashes, seq.prompt_tokens, hbm)]
            slot = len(self.running) + len(self.pulling) < self.timing.max_batch
            if not (slot and cache.fits(hit, need - len(hit))):
                if self._preempt_for(seq):
                    continue
                break
            self.waiting.popleft()
            queried = seq.prompt_tokens if seq.prefix is not None else 0
            seq.holding = cache.take(hit, need - len(hit), queried, loaded)
            seq.cached_tokens = (len(hit) + len(loaded)) * self.timing.block_size
            seq.cpu_tokens = len(loaded) * self.timing.block_size
            seq.kv_blocks, seq.admitted_at = need, now
            if seq.pull is not None:
                seq.state = PULLING
                self.pulling.append(seq)
            else:
                seq.state = RUNNING
                seq.prefilled = seq.cached_tokens
                self.running.append(seq)
            admitted.append(seq)
        return admitted

    def kv_loaded(self, seq: Sequence) -> None:
        """A pulled sequence's KV cache arrived: it decodes from the next step on."""
        self._start(seq)
        seq.prefilled = seq.prompt_tokens
        self._computed(seq)

    def _computed(self, seq: Sequence, generated: int = 0) -> None:
        """``seq`` now holds the full blocks of its prompt and ``generated`` output tokens: cache them."""
        if seq.prefix is not None:
            hashes = seq.prefix.with_output(generated)
            if hashes:
                self.cache.cache(seq.holding, hashes, seq.prefix.output_content(generated))

    def recompute(self, seq: Sequence) -> None:
        """A pulled sequence's KV cache cannot be loaded.

        It prefills locally from the next step on (its cached leading blocks still count)."""
        self._start(seq)
        seq.prefilled = seq.cached_tokens

    def _start(self, seq: Sequence) -> None:
        self.pulling.remove(seq)
        seq.state = RUNNING
        self.running.append(seq)

    def plan(self) -> StepPlan | None:
        """The next step, or ``None`` when no running sequence has work.

        Under the ``priority`` policy, the decoding sequences first get the block their next token
        needs (:meth:`_grow`), preempting as vLLM does."""
        if self.by_priority:
            self._grow()
        decode = [s for s in self.running if s.prefilled >= s.context_tokens]
        budget = self.timing.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.prefilled < seq.context_tokens and budget > 0:
                chunk = min(seq.context_tokens - seq.prefilled, budget)
                prefill.append((seq, chunk))
                budget -= chunk
        if not decode and not prefill:
            return None
        context = sum(s.prompt_tokens + s.generated for s in decode)
        pairs = sum(n * (2 * s.prefilled + n) for s, n in prefill)
        loads = [s for s in self.running if s.cpu_tokens and not s.cpu_loaded]
        ms = (
            self.timing.decode_ms(len(decode), context)
            + self.timing.prefill_ms(sum(n for _, n in prefill), len(prefill), pairs)
            + self.kv.cpu_load_ms(sum(s.cpu_tokens for s in loads))
        )
        return StepPlan(prefill, decode, ms / 1e3, loads)

    def _grow(self) -> None:
        """Give each decoding sequence the KV block its next token needs, preempting when none is free.

        The victim is the running sequence of the lowest priority, the latest arrival among equals
        (vLLM: ``max(running, key=(priority, arrival_time))``), possibly the one asking."""
        size = self.timing.block_size
        for seq in list(self.running):
            if seq.state != RUNNING or seq.prefilled < seq.context_tokens:
                continue  # preempted meanwhile, or still prefilling (its context's blocks are taken)
            missing = -(-(seq.prompt_tokens + seq.generated) // size) - seq.kv_blocks
            while missing > 0 and seq.state == RUNNING:
                if self.cache.fits((), missing):
                    seq.holding.private += self.cache.take((), missing, 0).private
                    seq.kv_blocks += missing
                    missing = 0
                else:
                    self.preempt(max(self.running, key=lambda s: (s.priority, s.arrival)))

    def _preempt_for(self, seq: Sequence) -> bool:
        """Under ``priority-preempt``, preempt the lowest-priority running sequence for the waiting ``seq``
        if ``seq``'s priority is more than :data:`PREEMPTION_THRESHOLD` better; whether it did."""
        if not self.preempts_to_admit or not self.running:
            return False
        victim = max(self.running, key=lambda s: (s.priority, s.arrival))
        if victim.priority - seq.priority <= PREEMPTION_THRESHOLD:
            return False
        self.preempt(victim)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Preempt the running ``seq``: free its blocks, queue it to recompute its prompt and output."""
        self.running.remove(seq)
        self.free(seq)
        seq.state, seq.resumed, seq.prefilled = WAITING, seq.generated, 0
        seq.pull, seq.cpu_tokens, seq.cpu_loaded = None, 0, False
        seq.preemptions += 1
        self.preemptions += 1
        self._enqueue(seq)

    def apply(self, plan: StepPlan, now: float) -> list[Sequence]:
        """Account a step ending at ``now``; return the sequences that gained a token."""
        progressed: list[Sequence] = []
        for seq in plan.loads:
            seq.cpu_loaded = True
        for seq, chunk in plan.prefill:
            if seq.state == RUNNING:
                seq.prefilled += chunk
                if seq.prefilled >= seq.context_tokens:
                    progressed.append(seq)
                    self._computed(seq)
        progressed.extend(s for s in plan.decode if s.state == RUNNING)
        for seq in progressed:
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.generated >= seq.output_tokens:
                seq.state, seq.finished_at = FINISHED, now
                self._dequeue(seq)
                self._computed(seq, seq.generated)  # the blocks its output filled are cached too
                if seq.hold is None:
                    self.free(seq)
        return progressed

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its KV blocks (no-op once it is done)."""
        if seq.done:
            return
        if seq.state == WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        else:
            self._dequeue(seq)
            self.free(seq)
        seq.state = ABORTED

    def free(self, seq: Sequence) -> None:
        """Free the KV blocks ``seq`` reserves (a finished sequence's held blocks included).

        The cached ones stay cached until evicted."""
        self.cache.release(seq.holding)
        seq.kv_blocks = 0

    def _dequeue(self, seq: Sequence) -> None:
        for queue in (self.running, self.pulling):
            if seq in queue:
                queue.remove(seq)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet in the batch: queued, plus admitted ones still pulling their KV."""
        return len(self.waiting) + len(self.pulling)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks reserved, 0..1."""
        return self.used_blocks / self.timing.kv_capacity_blocks


class Engine:
    """One simulated engine: scheduler loop, KV pulls and metrics. Needs a running event loop.

    Engines that share ``clock``, ``link`` and ``groups`` model one cluster in one process.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: SimClock | None = None,
        link: SharedLink | None = None,
        groups: GroupMap | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SimClock(config.timing.time_scale)
        self.scheduler = Scheduler(config.timing, config.kv)
        sched = self.scheduler
        self._holds: dict[tuple[int, ...], tuple[Sequence, asyncio.TimerHandle]] = {}
        self._held_keys: dict[str, Sequence] = {}
        self._key_waiters: dict[str, asyncio.Event] = {}
        self.metrics = EngineMetrics(
            config.model, lambda: len(sched.running), lambda: sched.num_waiting, lambda: sched.kv_usage
        )
        cache = sched.cache
        self.metrics.add_counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", lambda: cache.queries
        )
        self.metrics.add_counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", lambda: cache.hits
        )
        self.metrics.add_counter(
            "sim:prefix_cache_cpu_hits",
            "Prefix cache hits in the CPU KV tier, in loaded tokens.",
            lambda: cache.cpu_hits,
        )
        self.metrics.add_counter(
            "vllm:num_preemptions",
            "Running sequences preempted (recomputed later).",
            lambda: sched.preemptions,
        )
        self.metrics.add_gauge(
            "sim:kv_held_requests",
            "Finished prefills whose KV is held for a remote decode.",
            lambda: len(self._holds),
        )
        groups = groups if groups is not None else GroupMap(config.eds_files, config.eds_namespace)
        link = link or SharedLink(config.kv.cross_group_gbps * 1e9, self.clock)
        self.kv = KvTransferModel(config.kv, config.group, groups, link, self.clock)
        self.engine_id = f"sim-{uuid.uuid4().hex[:12]}"
        self.host = config.advertise_host or config.host
        self.port = config.port
        self._ids = itertools.count()
        self._block_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pulls: dict[Sequence, asyncio.Task[None]] = {}

    @property
    def address(self) -> str:
        """``"host:port"`` this engine advertises (port known once bound)."""
        return host_port(self.host, self.port)

    async def start(self) -> None:
        """Start the scheduler loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.engine_id}")

    async def stop(self) -> None:
        """Stop the loop and fail every sequence still inside the engine.

        Stop the loop, fail every sequence still inside the engine, free every hold and wake
        whoever waits for one (:meth:`wait_held` returns ``None``)."""
        tasks = [t for t in (self._task, *self._pulls.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        sched = self.scheduler
        for seq in [*sched.waiting, *sched.pulling, *sched.running]:
            self._fail(seq, EngineError("engine stopped"))
        for held, _ in list(self._holds.values()):
            self.release_kv(held)
        for waiter in self._key_waiters.values():  # their KV will never come: wake them to fail now
            waiter.set()
        self._key_waiters.clear()

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        output_tokens: int,
        pull: Pull | None = None,
        *,
        prefix: PromptBlocks | None = None,
        stops: bool = False,
        hold: Hold | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Queue a request; raise ``ValueError`` if it can never fit.

        Returns its :class:`Sequence` (see there for ``prefix``, ``stops``, ``hold`` and ``priority``;
        ``prefix`` is ignored unless the engine runs with ``enable_prefix_caching``, ``priority`` unless
        with the ``priority`` scheduling policy)."""
        seq = Sequence(
            request_id=f"{self.engine_id}-{next(self._ids)}",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            output_tokens=max(1, min(output_tokens, max_tokens)),
            arrival=self.clock.now(),
            pull=pull,
            prefix=prefix if self.config.timing.enable_prefix_caching else None,
            stops=stops,
            hold=hold,
            priority=priority,
        )
        self.scheduler.add(seq)
        self._wakeup.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Abandon ``seq`` (client went away); frees its batch slot and KV blocks."""
        if not seq.done:
            pull = self._pulls.pop(seq, None)
            if pull is not None and pull is not asyncio.current_task():
                pull.cancel()  # frees its share of the cross-group link
            self.scheduler.abort(seq)
            self.metrics.request_finished("abort")
            seq.ready.set()
            seq.progress.set()
            self._wakeup.set()

    def held(self, engine_id: str, block_ids: list[int]) -> Sequence | None:
        """The finished sequence whose KV this engine (``engine_id``) holds as ``block_ids``, if any."""
        if engine_id != self.engine_id:
            return None
        entry = self._holds.get(tuple(block_ids))
        return entry[0] if entry is not None else None

    def held_by_key(self, key: str) -> Sequence | None:
        """The finished sequence whose KV this engine holds under ``key``, if any."""
        return self._held_keys.get(key)

    async def wait_held(self, key: str, timeout_s: float) -> Sequence | None:
        """The sequence held under ``key`` once it is, or ``None`` after a timeout.

        The sequence held under ``key`` once it is (a prefill may finish after its decode asks),
        or ``None`` after ``timeout_s`` model seconds."""
        seq = self._held_keys.get(key)
        if seq is not None:
            return seq
        event = self._key_waiters.setdefault(key, asyncio.Event())
        try:
            await self.clock.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return None
        finally:
            if self._key_waiters.get(key) is event and not event.is_set():
                del self._key_waiters[key]
        return self._held_keys.get(key)

    def renew(self, key: str, seconds: float) -> bool:
        """Hold ``key``'s KV for ``seconds`` model seconds from now; ``False`` if none is held."""
        seq = self._held_keys.get(key)
        if seq is None:
            return False
        entry = self._holds[seq.held_block_ids]
        entry[1].cancel()
        self._holds[seq.held_block_ids] = (seq, self.clock.call_later(seconds, partial(self._expire, seq)))
        return True

    def release_kv(self, seq: Sequence) -> bool:
        """Free the KV blocks held for ``seq``; ``False`` if it holds none (never, or already freed)."""
        entry = self._holds.pop(seq.held_block_ids, None)
        if entry is None:
            return False
        entry[1].cancel()
        if seq.hold is not None and self._held_keys.get(seq.hold.key) is seq:
            del self._held_keys[seq.hold.key]
        self.scheduler.free(seq)
        self._wakeup.set()  # the freed blocks may admit a waiting sequence
        return True

    def _hold(self, seq: Sequence, hold: Hold) -> None:
        blocks = max(1, -(-seq.prompt_tokens // self.config.timing.block_size))
        seq.held_block_ids = tuple(next(self._block_ids) for _ in range(blocks))
        timer = self.clock.call_later(hold.seconds, partial(self._expire, seq))
        self._holds[seq.held_block_ids] = (seq, timer)
        self._held_keys[hold.key] = seq
        waiter = self._key_waiters.pop(hold.key, None)
        if waiter is not None:
            waiter.set()

    def _expire(self, seq: Sequence) -> None:
        if self.release_kv(seq):
            self.metrics.kv_holds_expired.inc()
            log.warning(
                "engine %s: freed the KV of %s, which no decode pulled before its hold ran out",
                self.address,
                seq.request_id,
            )

    async def wait_done(self, seq: Sequence) -> None:
        """Wait until ``seq`` finished; raise :class:`EngineError` if it failed or was aborted."""
        while not seq.done:
            seq.progress.clear()
            await seq.progress.wait()
        if seq.error is not None:
            raise EngineError(str(seq.error)) from seq.error

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        seq.error = error
        self.abort(seq)

    async def _run(self) -> None:
        while True:
            try:
                now = self.clock.now()
                for seq in self.scheduler.admit(now):
                    self.metrics.queue_time.observe(now - seq.arrival)
                    if seq.pull is None:
                        seq.ready.set()
                    else:
                        self._pulls[seq] = asyncio.create_task(self._pull(seq))
                plan = self.scheduler.plan()
                if plan is None:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                start = self.clock.now()
                await self.clock.sleep(plan.duration_s)
                self._account(self.scheduler.apply(plan, start + plan.duration_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep serving; fail what was in flight
                log.exception("engine %s step failed", self.address)
                for seq in list(self.scheduler.running):
                    self._fail(seq, exc)

    def _account(self, progressed: list[Sequence]) -> None:
        m = self.metrics
        m.generation_tokens.inc(len(progressed))
        for seq in progressed:
            if seq.generated == 1:
                m.prompt_tokens.inc(seq.prompt_tokens)
                m.ttft.observe(seq.first_token_at - seq.arrival)  # type: ignore[operator]
            if seq.state == FINISHED:
                m.request_finished(seq.finish_reason or "length")
                m.e2e.observe(seq.finished_at - seq.arrival)  # type: ignore[operator]
                if seq.generated > 1:
                    m.tpot.observe((seq.finished_at - seq.first_token_at) / (seq.generated - 1))  # type: ignore[operator]
                if seq.hold is not None:
                    self._hold(seq, seq.hold)
            seq.progress.set()

    async def _pull(self, seq: Sequence) -> None:
        assert seq.pull is not None
        missing: KvMissing | None = None
        try:
            seq.transfer = await seq.pull(seq.prompt_tokens - seq.cached_tokens)
        except asyncio.CancelledError:
            raise
        except KvMissing as exc:
            missing = exc
        except Exception as exc:
            log.warning("KV pull for %s failed: %s", seq.request_id, exc)
            self._fail(seq, exc)
            return
        finally:
            self._pulls.pop(seq, None)
        if seq.state != PULLING:  # aborted meanwhile
            return
        if missing is None:
            self.metrics.kv_transfer(seq.transfer.kind, seq.transfer.model_ms / 1e3)
            self.scheduler.kv_loaded(seq)
        elif isinstance(missing, KvLoadFailed) and self.config.kv.kv_load_failure_policy == "fail":
            log.warning("KV load for %s failed, failing the request: %s", seq.request_id, missing)
            self.metrics.kv_load_failures.inc()
            self._fail(seq, KvLoadError(str(missing)))
            return
        else:
            log.warning("KV load for %s failed, prefilling locally: %s", seq.request_id, missing)
            seq.warning = f"KV load failed, prefilled locally: {missing}"
            self.metrics.kv_recomputes.inc()
            self.scheduler.recompute(seq)
        seq.ready.set()
        self._wakeup.set()
