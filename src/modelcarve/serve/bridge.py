"""The engine on rank 0 as the HTTP side sees it: one stepping thread, a queue per request, backpressure, drain.

The engine (``runtime/engine/engine.py``, its module doc states the interface) is stepped by ONE thread here: a
step blocks on compute and collectives, and the asyncio loop of uvicorn must keep answering
(health, metrics, new requests, disconnects) meanwhile. ``admit`` runs on the event loop: it
refuses what the server cannot take (503 while draining, 429 with ``Retry-After`` when
``max_queue`` requests are already in the server), hands the request to
``engine.add_request`` (thread-safe, takes effect at the next step) and returns the asyncio
queue that receives the request's ``RequestOutput``s, put there with
``loop.call_soon_threadsafe``. ``abort`` (a client that went away) frees the request's blocks at
the engine's next step.

When nothing is in flight the thread still calls ``engine.step()`` every ``idle_step_s`` if
other ranks follow (world size > 1): an idle step sends the followers an empty plan every
``runtime.engine.HEARTBEAT_S``, so an idle server never trips their collective timeout. ``stop`` (after the drain) lets the thread leave
its loop and call ``engine.shutdown()``, which releases the followers; an engine failure
(a rank died) fails every request in flight with a 500 and marks the bridge ``broken`` so the
server exits with an error instead of hanging.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field

from modelcarve.serve.errors import APIError


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    arrival: float = field(default_factory=time.perf_counter)


class EngineFailed(RuntimeError):
    """The engine's step raised: every rank's state is suspect, the server must stop."""


class EngineBridge:
    """Owns ``engine`` on rank 0 for the server's lifetime (``start`` ... ``stop``)."""

    def __init__(self, engine, metrics, *, max_queue: int, followers: bool, idle_step_s: float = 1.0):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.followers = followers
        self.idle_step_s = idle_step_s
        self.draining = False
        self.broken: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-steps", daemon=True)
        self._recent_e2e: list[float] = []
        self.on_broken = None  # called (from the engine thread) when the engine fails

    # ---- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the mean end-to-end time of recent requests."""
        recent = self._recent_e2e[-32:]
        return max(1, math.ceil(sum(recent) / len(recent))) if recent else 1

    def check_open(self, needed: int = 1) -> None:
        """503 while draining or broken; 429 when admitting ``needed`` more would pass ``max_queue``."""
        if self.broken:
            raise APIError(503, f"the engine failed ({self.broken}); the server is stopping")
        if self.draining:
            self.metrics.rejected("draining")
            raise APIError(503, "the server is shutting down (draining in-flight requests); retry on another replica")
        if len(self._streams) + needed > self.max_queue:
            self.metrics.rejected("queue_full")
            retry = self.retry_after_s()
            raise APIError(429, f"the server's queue is full ({len(self._streams)} requests in flight, --max-queue "
                           f"{self.max_queue}); retry after {retry} s", headers={"Retry-After": str(retry)})

    def admit(self, rid: str, prompt_ids: list[int], params, queue: asyncio.Queue, index: int = 0) -> None:
        """Hand one request to the engine; its outputs arrive on ``queue`` as ``(index, output)``."""
        from modelcarve.spec.errors import ModelcarveError

        self._streams[rid] = _Stream(asyncio.get_running_loop(), queue, index)
        try:
            self.engine.add_request(rid, prompt_ids, params)
        except ModelcarveError as err:
            self._streams.pop(rid, None)
            self.metrics.rejected("bad_request")
            raise APIError(400, " ".join(str(err).split()), param="prompt") from None
        except Exception:
            self._streams.pop(rid, None)
            raise
        with self._wake:
            self._wake.notify()

    def abort(self, rid: str) -> None:
        """The client went away: stop generating ``rid`` and free its blocks (at the next step)."""
        if self._streams.pop(rid, None) is not None and not self.broken:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - already finished / unknown: nothing to free
                pass
            with self._wake:
                self._wake.notify()

    def finished(self, rid: str, e2e_s: float) -> None:
        self._streams.pop(rid, None)
        self._recent_e2e = (self._recent_e2e + [e2e_s])[-64:]

    def stats(self) -> dict:
        stats = self.engine.stats()
        return stats.to_dict() if hasattr(stats, "to_dict") else dict(stats)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self._streams and not self.broken:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return not self._streams

    def stop(self, join_s: float = 60.0) -> None:
        """Leave the stepping loop (aborting what is left) and shut the engine down on every rank."""
        for rid in list(self._streams):
            self.abort(rid)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(join_s)

    # ---- engine thread ---------------------------------------------------------------------

    def _deliver(self, out) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, out))

    def _has_work(self) -> bool:
        return bool(self._streams) or self.engine.has_unfinished()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    if not self._has_work() and not self._stopping:
                        self._wake.wait(self.idle_step_s)
                    work = self._has_work()
                    if self._stopping and not self.engine.has_unfinished():
                        break
                if not work and not self.followers:
                    continue
                for out in self.engine.step():
                    self._deliver(out)
                self.metrics.engine_stats(self.stats())
        except Exception as err:  # noqa: BLE001 - reported to every waiting request, then the server stops
            self.broken = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            for rid, stream in list(self._streams.items()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (stream.index, EngineFailed(self.broken)))
            if self.on_broken:
                self.on_broken(self.broken)
            return
        self.engine.shutdown()
