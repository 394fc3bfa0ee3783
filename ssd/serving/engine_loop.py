"""One engine for many callers: `run()` steps the LLM, and requests join and leave the
running batch between its steps (continuous batching, in AR, SD and SSD alike).

Callers (the HTTP server's handlers, in other threads) check and tokenize a request in their
own thread (`submit`, which raises the user's mistakes at once), then get `StreamChunk`s through a
callback called from the engine's thread. `cancel` takes effect before the next step and
frees the request's KV blocks. Everything else of the LLM is touched by the engine only.

`run()` belongs in the main thread, where the LLM was loaded and warmed up: the CPU kernels'
OpenMP team is that thread's. A second thread stepping the model starts a second team,
libgomp then counts more threads than cores and stops spinning between parallel regions,
and every kernel call pays a futex wake-up (measured: SmolLM2's decode step 9 -> 14-18 ms).
"""
import logging
import threading
from collections.abc import Callable

import torch

from ssd.errors import SSDError
from ssd.llm import LLM
from ssd.outputs import StreamChunk
from ssd.request.sequence import Sequence
from ssd.sampling_params import SamplingParams

log = logging.getLogger("ssd.serving")


class QueueFullError(SSDError):
    """Too many requests are waiting for a place in the running batch."""


class ShuttingDownError(SSDError):
    """The engine is stopping and takes no new requests."""


Sink = Callable[[StreamChunk], None]


class EngineLoop:
    def __init__(self, llm: LLM, max_queue: int = 64, on_step: Callable[[LLM], None] | None = None):
        self.llm = llm
        self.max_queue = max_queue  # requests waiting for the batch, beyond llm's max_num_seqs running
        self.on_step = on_step or (lambda llm: None)  # after every step, in the engine thread
        self._cond = threading.Condition()
        self._incoming: list[tuple[Sequence, Sink]] = []
        self._cancelled: list[Sequence] = []
        self._sinks: dict[int, Sink] = {}  # seq_id -> sink, engine thread only
        self._stopping = False
        self._running = False
        self._done = threading.Event()
        self.failed_steps = 0

    @property
    def alive(self) -> bool:
        """Taking requests: not stopping or stopped."""
        return not self._stopping

    def queued(self) -> int:
        """Requests accepted but not running yet."""
        return len(self._incoming) + self.llm.num_waiting

    def tracked(self) -> int:
        """Requests whose events are still routed to a caller (0 when none is in flight)."""
        return len(self._sinks)

    def running(self) -> int:
        return self.llm.num_running

    def submit(self, prompt, params: SamplingParams, sink: Sink, fill_context: bool = False,
               tools=None) -> Sequence:
        """Check and queue a request (tools: ssd.tools.Tools or None); its events go to `sink`
        (called in the engine thread). Raises the engine's SSDErrors for bad input,
        QueueFullError, ShuttingDownError."""
        seq = self.llm.new_request(prompt, params, fill_context, tools=tools)
        with self._cond:
            if not self.alive:
                raise ShuttingDownError("the server is shutting down and takes no new requests")
            if self.queued() >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._incoming.append((seq, sink))
            self._cond.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a request (its client went away); no more events come for it."""
        with self._cond:
            self._cancelled.append(seq)
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Make run() cancel what is still in flight and return; wait for it (from another
        thread) for up to `timeout` seconds. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._running:
            self._done.wait(timeout)

    # ---- the engine ---------------------------------------------------------------------------
    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Step the engine until stop() is called or keep_going() turns False (checked at
        least twice a second); then fail what is left and close the LLM (and with it the SSD
        draft worker)."""
        torch.set_num_threads(self.llm.config.threads)
        self._running = True
        try:
            while True:
                with self._cond:
                    while not (self._incoming or self._cancelled or self._stopping or self.llm.unfinished()):
                        if not keep_going():
                            self._stopping = True
                            break
                        self._cond.wait(0.5)
                    incoming, self._incoming = self._incoming, []
                    cancelled, self._cancelled = self._cancelled, []
                    stopping = self._stopping
                for seq, sink in incoming:
                    self._sinks[seq.seq_id] = sink
                    self.llm.add_request(seq)
                self._drop(cancelled)
                if stopping:
                    self._fail(self.llm.unfinished(),
                               "the server shut down before the request finished")
                    return
                if self.llm.unfinished():
                    self._step()
        finally:
            self._stopping = True
            self.llm.close()
            self._done.set()

    def _step(self) -> None:
        try:
            chunks = self.llm.step()
        except Exception as e:  # a bug or a resource failure: fail the batch, keep serving
            self.failed_steps += 1
            log.exception("ssd: an engine step failed")
            self._fail(self.llm.unfinished(),
                       f"the engine failed: {type(e).__name__}: {e}")
            return
        for seq, chunk in chunks:
            sink = self._sinks.get(seq.seq_id)
            if sink is None:
                continue
            if seq.finished:
                del self._sinks[seq.seq_id]
            sink(chunk)
        self.on_step(self.llm)

    def _drop(self, seqs: list[Sequence]) -> None:
        self.llm.abort(seqs)
        for seq in seqs:
            self._sinks.pop(seq.seq_id, None)
        if seqs:
            self.on_step(self.llm)

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        sinks = [self._sinks.get(s.seq_id) for s in seqs]
        self._drop(seqs)
        for seq, sink in zip(seqs, sinks):
            if sink is not None:
                sink(StreamChunk("", [], [], "error", seq.metrics(), error=message))
