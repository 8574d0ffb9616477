"""The server's engine side: a bounded FIFO of requests run one at a time on a worker thread.

The HTTP side submits a `Job` and reads its events; the worker runs the job on the system's engine
(greedy or sampled, speculative or not: the tokens are the same), streaming each token as it is
decided and stopping as soon as the job is cancelled (its client went away) or a stop string
appears.  A finished or cancelled job gives its cache-pool row back at once.  The queue is
bounded: a full queue refuses new jobs (the server answers 429).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specpilot.core.errors import SpecPilotError
from specpilot.core.sampling import SamplingParams


class QueueFull(Exception):
    """The waiting queue is at its bound."""


@dataclass
class Job:
    prompt: list[int]
    max_new: int
    sampling: SamplingParams | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)   # ("text", str, tokens) ... ("done", reason, info)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Metrics:
    """What /metrics exposes (Prometheus text), in the server's own registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specpilot_requests", "requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("specpilot_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated = Counter("specpilot_generation_tokens", "tokens generated", registry=r)
        self.verifications = Counter("specpilot_verifications", "target passes (verifications)", registry=r)
        self.queue_depth = Gauge("specpilot_queue_depth", "requests waiting", registry=r)
        self.running = Gauge("specpilot_running", "requests running", registry=r)
        self.latency = Histogram("specpilot_request_seconds", "submission to last token", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.step = Histogram("specpilot_verification_seconds", "mean time of a request's target passes",
                              registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.acceptance = Histogram("specpilot_tokens_per_verification", "a request's tokens per target pass",
                                    registry=r, buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16))


class Scheduler:
    """FIFO of single requests on ``engine`` of ``system`` (`runtime.systems.System`)."""

    def __init__(self, system, engine: str, queue_size: int, metrics: Metrics, detokenize):
        self.system, self.engine, self.metrics, self.detokenize = system, engine, metrics, detokenize
        self.waiting: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.worker = threading.Thread(target=self._work, name="specpilot-engine", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> None:
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            self.metrics.requests.labels("rejected").inc()
            raise QueueFull from None
        self.metrics.queue_depth.set(self.waiting.qsize())

    def close(self) -> None:
        self.waiting.put(None)
        self.worker.join(timeout=30)

    def _work(self) -> None:
        while True:
            job = self.waiting.get()
            self.metrics.queue_depth.set(self.waiting.qsize())
            if job is None:
                return
            if job.cancelled.is_set():
                self.metrics.requests.labels("cancelled").inc()
                continue
            self.metrics.running.set(1)
            try:
                self._run(job)
            except SpecPilotError as e:
                self.metrics.requests.labels("error").inc()
                job.emit("error", str(e), None)
            except Exception as e:   # an engine fault fails this request, not the server
                self.metrics.requests.labels("error").inc()
                job.emit("error", f"internal error: {type(e).__name__}: {e}", None)
            finally:
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        stream = _TextStream(job, self.detokenize)
        gen = self.system.generate(self.engine, job.prompt, job.max_new, stop_at_eos=True,
                                   sampling=job.sampling, on_token=stream.push)
        m = self.metrics
        m.prompt_tokens.inc(len(job.prompt))
        m.generated.inc(len(stream.tokens))
        m.verifications.inc(len(gen.accepted))
        if gen.accepted:
            m.step.observe(gen.seconds / len(gen.accepted))
            m.acceptance.observe(gen.mean_accepted)
        m.latency.observe(time.perf_counter() - job.submitted)
        if job.cancelled.is_set():
            m.requests.labels("cancelled").inc()
            return
        m.requests.labels("completed").inc()
        at_eos = bool(stream.tokens) and stream.tokens[-1] in self.system.eos_ids
        reason = "stop" if stream.stopped or at_eos else "length"
        stream.finish(reason, {"verifications": len(gen.accepted), "seconds": gen.seconds})


class _TextStream:
    """Incremental text of a job's tokens: emits each new piece of text once it is whole UTF-8, and
    stops the generation at a stop string (which is not emitted) or a cancellation."""

    def __init__(self, job: Job, detokenize):
        self.job, self.detokenize = job, detokenize
        self.tokens: list[int] = []
        self.sent_text, self.sent_tokens = "", 0
        self.stopped = False

    def push(self, token: int) -> bool:
        if self.job.cancelled.is_set():
            return False
        self.tokens.append(token)
        text = self.detokenize(self.tokens)
        cut = min((i for i in (text.find(s, max(0, len(self.sent_text) - len(s))) for s in self.job.stops)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._send(text[:cut])
            return False
        if text.endswith("\ufffd"):     # a character cut in the middle: wait for its other bytes
            return True
        held = max((len(s) - 1 for s in self.job.stops), default=0)   # a stop string may be starting
        self._send(text[:len(text) - held] if held else text)
        return True

    def _send(self, text: str) -> None:
        if len(text) > len(self.sent_text) and text.startswith(self.sent_text):
            self.job.emit("text", text[len(self.sent_text):], self.tokens[self.sent_tokens:])
            self.sent_text, self.sent_tokens = text, len(self.tokens)

    def finish(self, reason: str, info: dict) -> None:
        if not self.stopped:
            text = self.detokenize(self.tokens)
            if len(text) > len(self.sent_text):
                self.job.emit("text", text[len(self.sent_text):], self.tokens[self.sent_tokens:])
            elif len(self.tokens) > self.sent_tokens:
                self.job.emit("text", "", self.tokens[self.sent_tokens:])
        elif len(self.tokens) > self.sent_tokens:
            self.job.emit("text", "", self.tokens[self.sent_tokens:])
        self.job.emit("done", reason, info)
