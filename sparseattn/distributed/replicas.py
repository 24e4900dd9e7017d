"""The client side of the Dask key store's fault tolerance: the actors of every shard replica and the calls
to them, waited in short slices (a closed client or a lost worker ends a wait at once), health checks
after a failure, retries on the next replica, and lost replicas dropped for good."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from .checks import describe
from .shard import Shard, ShardInfo

__all__ = ["GONE", "PING_TIMEOUT", "POLL", "ClientClosedError", "Replicas", "ShardError", "ShardGone"]

#: Seconds a health check waits for a shard's answer to a ping before calling it unresponsive (which does
#: not condemn it: only a shard whose worker or state is gone is dropped).
PING_TIMEOUT = 10.0
#: Seconds between checks, while a shard call runs, that the client is still open and the shard's worker
#: still holds it (so a wait ends soon after either is lost, whatever the timeout).
POLL = 0.2
#: Status of an actor's key once its worker is gone (or its client released it).
GONE = ("lost", "error", "cancelled")


class ShardError(RuntimeError):
    """A shard could not answer (its worker died, or its computation raised); no partial result is given."""


class ClientClosedError(RuntimeError):
    """The store's Dask client is closed (or not connected), so the store cannot reach its shards.

    The cluster drops a closed client's shards, so the store cannot be reused: build a new
    :class:`~sparseattn.distributed.ShardedKeyStore` with a live client.
    """


class ShardGone(Exception):
    """The key of a shard's actor is no longer held by the cluster (worker lost)."""


class Replicas:
    """The actors of every (shard, replica) and every call to them.

    ``actors[i][r]`` is replica r of shard i on worker ``workers[i][r]``; ``dead`` maps a lost (i, r) to why,
    ``order[i]`` is shard i's replica preference (a replica that failed while alive goes last), ``stats``
    the running totals of :attr:`ShardedKeyStore.stats` (``lock`` guards them).  ``shards`` (set once the
    store is built) names the shards in error messages.
    """

    def __init__(self, client: Any, timeout: float | None) -> None:
        self.client = client
        self.timeout = timeout
        self.futures: list[list[Any]] = []
        self.actors: list[list[Any]] = []
        self.workers: list[list[str]] = []
        self.shards: list[ShardInfo] = []
        self.dead: dict[tuple[int, int], str] = {}
        self.order: list[list[int]] = []
        self.lock = threading.Lock()
        self.stats = {"calls": 0, "queries": 0, "bytes_sent": 0, "bytes_received": 0, "retries": 0}

    def spawn(self, bounds: list[int], addrs: list[str], replicas: int, selector: str,
              nthreads: dict[str, int]) -> None:
        """One :class:`Shard` actor per (shard, replica) for the row ranges ``bounds``: replica r of shard i
        lives on worker ``addrs[(i + r) % len(addrs)]``.  Every actor is created before any is waited for."""
        for i in range(len(bounds) - 1):
            start, stop = bounds[i], bounds[i + 1]
            ws = [addrs[(i + r) % len(addrs)] for r in range(replicas)]
            futs = [self.client.submit(Shard, selector, stop - start, start, nthreads[w], actor=True,
                                       workers=[w], allow_other_workers=False, pure=False) for w in ws]
            self.futures.append(futs)
            self.workers.append(ws)
        self.actors = [[self.wait(f, i, "creating", r) for r, f in enumerate(futs)]
                       for i, futs in enumerate(self.futures)]
        self.order = [list(range(len(actors))) for actors in self.actors]

    def each(self, i: int) -> Iterable[tuple[int, Any]]:
        """(replica, actor) of every replica of shard i."""
        return enumerate(self.actors[i])

    def wait(self, fut: Any, shard: int, action: str, replica: int | None = None) -> Any:
        """Result of one construction call to ``replica`` of ``shard``, within the store's timeout."""
        try:
            return self.await_result(fut, self.timeout, shard, replica)
        except ClientClosedError:
            raise
        except (ValueError, TypeError) as exc:  # the shard rejected its input: the caller's mistake
            raise type(exc)(f"shard {shard}: {exc}") from exc
        except Exception as exc:
            raise ShardError(f"{action} shard {shard} on worker(s) {self.workers[shard]} failed: "
                             f"{describe(exc)}") from exc

    def check_client(self) -> None:
        """Raise ClientClosedError unless the client can reach the cluster (checked before any blocking call)."""
        status = getattr(self.client, "status", "closed")
        if status != "running":
            raise ClientClosedError(
                f"the store's Dask client is {status}, not running, so the store cannot reach its shards (and "
                f"the cluster drops the shards of a closed client). Keep the client open while the store is in "
                f"use, or build a new ShardedKeyStore with a live client.")

    def gone(self, i: int, r: int) -> str | None:
        """Why replica r of shard i is lost for good, from the cluster's own record; None while it is held."""
        futs = self.futures[i] if i < len(self.futures) else []
        status = futs[r].status if r < len(futs) else "finished"
        if status in GONE:
            return f"its worker {self.workers[i][r]} was lost (the cluster reports the shard {status})"
        return None

    def await_result(self, fut: Any, timeout: float | None, i: int | None = None, r: int | None = None) -> Any:
        """``fut.result()``, waited in short slices: ends with ClientClosedError once the client closes,
        ``ShardGone`` once replica r of shard i is lost, TimeoutError after ``timeout`` seconds."""
        t0 = time.monotonic()
        while not fut.done():
            self.check_client()
            if r is not None and (why := self.gone(i, r)) is not None:
                raise ShardGone(why)
            step = POLL
            if timeout is not None:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError(f"no answer within timeout={timeout:g} s")
                step = min(step, left)
            try:
                return fut.result(timeout=step)
            except TimeoutError:
                continue  # the slice ran out (or the call itself raised TimeoutError: done, re-raised below)
        self.check_client()
        return fut.result(timeout=POLL * 10)

    def health(self, i: int, r: int) -> str | None:
        """Health check of replica r of shard i after a failed call: why it is lost for good, or None.

        Only a replica whose worker is gone, whose worker refuses the ping, or whose shard state is gone is
        lost; a slow or busy one (a timeout, or a ping unanswered within PING_TIMEOUT) is not condemned.
        """
        self.check_client()
        why = self.gone(i, r)
        if why is not None:
            return why
        try:
            built = self.await_result(self.actors[i][r].ping(), PING_TIMEOUT, i, r)
        except ClientClosedError:
            raise
        except ShardGone as exc:
            return str(exc)
        except TimeoutError:
            return None  # busy (or slow to answer): not evidence of death
        except Exception as exc:
            return self.gone(i, r) or f"its worker {self.workers[i][r]} does not answer ({describe(exc)})"
        return None if built else f"its shard state on worker {self.workers[i][r]} is gone (cleared)"

    def live(self, i: int) -> list[int]:
        """Replicas of shard i not found lost, in order of preference."""
        with self.lock:
            return [r for r in self.order[i] if (i, r) not in self.dead]

    def submit(self, i: int, r: int, method: str, args: tuple) -> tuple[Any, BaseException | None]:
        """Send one call to replica r of shard i: (future, None), or (None, the error) if it could not go."""
        try:
            return getattr(self.actors[i][r], method)(*args), None
        except Exception as exc:  # e.g. dask's "Worker holding Actor was lost" for a worker gone since
            return None, exc

    def call(self, i: int, method: str, args: tuple) -> tuple[int, Any, BaseException | None]:
        """Send ``method(*args)`` to the preferred live replica of shard i: (replica, future or None, error)."""
        live = self.live(i)
        if not live:
            raise self.lost(i, [])
        r = live[0]
        with self.lock:
            self.stats["calls"] += 1
            self.stats["bytes_sent"] += sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        return (r, *self.submit(i, r, method, args))

    def result(self, i: int, method: str, args: tuple, call: tuple[int, Any, BaseException | None],
                timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
        """The answer of shard i, retried on its other live replicas after a failure.

        A failed replica is dropped only when its health check says it is lost (:meth:`_health`); a
        timeout or an error of a healthy replica fails this call only.
        """
        r, fut, err = call
        tried = [r]
        failures: list[str] = []
        while True:
            if fut is not None:
                try:
                    res = self.await_result(fut, timeout, i, r)
                    err = None
                except ClientClosedError:
                    raise
                except (ValueError, TypeError) as exc:  # the shard's own checks refused the input
                    raise type(exc)(f"queries refused by shard {i}: {exc}") from exc
                except Exception as exc:
                    err = exc
                if err is None:
                    a, b = (np.asarray(x) for x in res)
                    with self.lock:
                        self.stats["bytes_received"] += a.nbytes + b.nbytes
                    return a, b
            why = self.health(i, r)
            with self.lock:
                if why is not None:
                    self.dead[(i, r)] = why
                elif len(self.order[i]) > 1:  # alive but failed: ask the other replicas first next time
                    self.order[i].remove(r)
                    self.order[i].append(r)
            if why is not None:
                state = f"dropped: {why}"
            elif isinstance(err, TimeoutError):
                state = ("the worker is alive and may still be computing the abandoned call, which later calls "
                         "to it wait behind; the replica stays in use")
            else:
                state = "the worker is alive; the replica stays in use"
            failures.append(f"replica {r} on {self.workers[i][r]}: {describe(err)} ({state})")
            nxt = [x for x in self.live(i) if x not in tried]
            if not nxt:
                raise self.lost(i, failures) from err
            r = nxt[0]
            tried.append(r)
            with self.lock:
                self.stats["retries"] += 1
            fut, err = self.submit(i, r, method, args)

    def lost(self, i: int, failures: list[str]) -> ShardError:
        """The ShardError of shard i after ``failures`` (one line per failed replica call)."""
        s = self.shards[i]
        dropped = [f"replica {r} on {self.workers[i][r]}: {why}" for (j, r), why in list(self.dead.items()) if j == i]
        cause = "; ".join(failures) if failures else "every replica was lost earlier: " + "; ".join(dropped)
        alive = len(self.live(i))
        advice = (f"{alive} replica(s) are still alive: the call can be repeated (raise timeout= if it timed "
                  f"out)" if alive else "no replica is left: rebuild the store (ShardedKeyStore(...)) on live "
                  "workers, or build it with replicas=2 to survive a worker loss")
        return ShardError(
            f"shard {i} (rows [{s.start}, {s.stop}), positions [{s.first_position}, {s.last_position}]) on "
            f"worker(s) {list(s.workers)} failed ({cause}). No partial answer is returned; {advice}.")

    def ask(self, targets: list[tuple[int, int]], method: str, action: str) -> list[Any]:
        """One argument-free call per (shard, replica), sent together; None for a replica found lost."""
        self.check_client()
        calls = [(i, r, *self.submit(i, r, method, ())) for i, r in targets]
        out = []
        for i, r, fut, err in calls:
            if fut is not None:
                try:
                    out.append(self.await_result(fut, self.timeout, i, r))
                    continue
                except ClientClosedError:
                    raise
                except Exception as exc:
                    err = exc
            why = self.health(i, r)
            if why is None:
                raise ShardError(f"{action} shard {i} on worker {self.workers[i][r]} failed: "
                                 f"{describe(err)}") from err
            with self.lock:
                self.dead[(i, r)] = why
            out.append(None)
        return out

    def release(self) -> None:
        """Clear every shard's state on its worker and release the actors (the client stays open)."""
        if getattr(self.client, "status", "closed") == "running":  # else the cluster dropped the shards
            calls = []
            for actors in self.actors:
                for a in actors:
                    try:
                        calls.append(a.clear())
                    except Exception:  # a lost worker holds nothing any more
                        pass
            deadline = time.monotonic() + 10.0
            for c in calls:
                try:
                    c.result(timeout=max(0.01, deadline - time.monotonic()))
                except Exception:
                    pass
        for futs in self.futures:
            for f in futs:
                try:
                    f.release()
                except Exception:  # a closed client has released them already
                    pass
        self.futures = []
        self.actors = []
