"""Server-side deadlines: a call that outlives its limit is cancelled, freeing its thread.

gRPC's synchronous server gives each call a worker thread until the call ends, and a call
ends by the client's deadline only if the client set one. A member that opens pushes and
never sends, or a joiner that stops reading its state download, would otherwise hold threads
and admission slots for good. :class:`CallDeadlines` keeps one thread for every watched call:
at a call's deadline it cancels the call (its blocked read or write then fails and the
handler's ``finally`` frees its slots). A watch can be pushed back (:meth:`Watch.extend`),
so a long download that keeps moving is cut only when it stalls.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

import grpc

log = logging.getLogger(__name__)


class Watch:
    """One watched call; :meth:`CallDeadlines.release` it when the call ends."""

    __slots__ = ("context", "deadline", "done", "what")

    def __init__(self, context: grpc.ServicerContext | None, deadline: float, what: str) -> None:
        self.context = context
        self.deadline = deadline
        self.done = False
        self.what = what

    def extend(self, seconds: float) -> None:
        """Move the deadline to ``seconds`` from now (progress was made)."""
        self.deadline = time.monotonic() + seconds


class CallDeadlines:
    """Cancels watched server calls at their deadlines, from one daemon thread that runs
    while some call is watched.

    Example::

        watch = deadlines.watch(context, 5.0, "push")
        try:
            ...  # read the stream
        finally:
            deadlines.release(watch)
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._live = 0  # watches not yet released
        #: Calls cancelled at their deadline so far.
        self.cancelled = 0

    def watch(self, context: grpc.ServicerContext, seconds: float, what: str) -> Watch:
        """Cancel the call of ``context`` unless released within ``seconds``."""
        w = Watch(context, time.monotonic() + seconds, what)
        with self._cond:
            heapq.heappush(self._heap, (w.deadline, next(self._seq), w))
            self._live += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="call-deadlines", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return w

    def release(self, watch: Watch) -> None:
        """The call ended: no longer watched. It leaves the heap at its deadline; its context
        is dropped now (gRPC counts a call as in flight while its context lives)."""
        with self._cond:
            if watch.context is not None:
                self._live = max(0, self._live - 1)  # 0 already if closed meanwhile
            watch.done = True
            watch.context = None
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread (the server stopped; its calls are cancelled anyway). A later
        :meth:`watch` starts a new one."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._heap.clear()
            self._live = 0
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                if self._live == 0:
                    self._heap.clear()  # only released watches left: nothing to cancel
                if self._thread is not me:
                    return
                if not self._heap:  # idle: the next watch starts a thread again
                    self._thread = None
                    return
                at, _, w = self._heap[0]
                now = time.monotonic()
                if at > now:
                    self._cond.wait(at - now)
                    continue
                heapq.heappop(self._heap)
                if w.done:
                    continue
                if w.deadline > now:  # extended meanwhile
                    heapq.heappush(self._heap, (w.deadline, next(self._seq), w))
                    continue
                w.done = True
                self._live -= 1
                self.cancelled += 1
                context, w.context = w.context, None
            log.info("%s from %s outlived its deadline: cancelled", w.what, context.peer())
            try:
                context.cancel()
            except Exception:  # the call may have ended under us
                log.debug("cancelling %s failed", w.what, exc_info=True)
