"""Engine pool (layer 5): the `RolloutEngine` contract over K engine replicas.

Why: rollout is the stage every RL step waits on; one engine on one device leaves the other devices
idle.  The pool lets the scheduler (and sync mode's generate phase) drive K replicas exactly as it
drives one engine, so nothing above it changes with K.

Routing.  Requests wait in the pool's own FIFO queue and are dispatched only while a replica has a
free slot (`max_num_seqs` per replica), so no replica holds a backlog while another idles, and a
replica that finishes early takes the next work.  All requests of a prompt group (`GenRequest.group_id`,
the `rollout.n` samples) go to the replica that already holds that group while it has room (its prefix
cache serves the shared prompt); a new group goes to the least-loaded replica.

Progress.  `collect()` runs one iteration of each inline replica in this thread and gathers what the
remote replicas (each generating continuously in its own process) finished meanwhile: one outstanding
poll per busy replica, waited for together, but only while no inline replica has work (an inline engine
advances only while this thread steps it).

Weights and pauses reach every replica: `interrupt()` stops all (queued requests come back as empty
aborted outputs), `update_weights()` puts the tensors into Ray's object store once and every remote
replica reads the same object; the collective path is one broadcast group of 1 + the receivers of all
replicas, each joining at its own rank offset; `sleep`/`wake_up` go to all.  The pool's `version`
changes only after every replica loaded, so every replica stamps tokens with the same version.

Lent replicas (async_training.placement=elastic): `join(replicas)` adds engines another side owns (the
engines on the trainer's devices) while that side lends them; they take requests like the pool's own, but weight
loads, sleep / wake-up and the weight-broadcast group stay with their owner (it loads them in its own process).
`leave(indices)` takes them out again: what they held comes back, finished or aborted (partial), and no request
goes to them until they join again.  `capacity` counts only the replicas that take requests now.

Observability: per replica the tokens it generated and the time it had work (`busy_s`, from the pool's
view: a request assigned and not yet returned), plus one timeline track per replica.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from typing import Any, Optional

from fully_async.telemetry.timeline import Timeline
from fully_async.core.types import GenOutput, GenRequest

logger = logging.getLogger(__name__)


class ReplicaFailed(RuntimeError):
    """A replica's process died or its engine raised; the message names the replica."""


class EnginePool:
    def __init__(self, replicas: list[Any], max_num_seqs: int, timeline: bool = False, version: int = 0):
        if not replicas:
            raise ValueError("an engine pool needs at least one replica")
        self.replicas = list(replicas)
        self.own = len(replicas)      # the pool's own replicas; those after them are lent (`join`)
        self.active = [True] * len(replicas)   # which replicas take requests now
        self._lent: dict[str, int] = {}        # a lent replica's name -> its index
        self.max_num_seqs = max_num_seqs
        self.version = version
        self.last_update_timings: dict[str, float] = {}
        k = len(replicas)
        self._queue: deque[GenRequest] = deque()
        self._assigned: list[set[str]] = [set() for _ in range(k)]
        self._where: dict[str, tuple[int, str]] = {}         # request id -> (replica, group id)
        self._group_home: dict[str, tuple[int, int]] = {}   # group id -> (replica, requests there)
        self._polls: dict[int, concurrent.futures.Future] = {}
        self._ready: list[GenOutput] = []                    # outputs gathered while settling polls
        self.tokens = [0] * k
        self.busy_s = [0.0] * k
        self._busy_since: list[Optional[float]] = [None] * k
        self.finished = [0] * k                              # responses each replica finished (not aborted)
        self._timeline_on = timeline
        self.timelines = [Timeline(f"engine_{i}", timeline) for i in range(k)]
        self._keeps: Optional[bool] = None

    # ------------------------------------------------------------------ contract
    @property
    def capacity(self) -> int:
        """Sequences the pool decodes at once (K x max_num_seqs, K: the replicas taking requests now)."""
        return self.max_num_seqs * sum(self.active)

    @property
    def keeps_in_flight(self) -> bool:
        """True when every replica's engine continues in-flight requests across a weight update."""
        if self._keeps is None:
            self._keeps = all(self._all("keeps_in_flight"))
        return self._keeps

    def submit(self, requests: list[GenRequest]) -> None:
        self._queue.extend(requests)
        self._dispatch()

    def num_in_flight(self) -> int:
        return len(self._queue) + len(self._where)

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        self._dispatch()
        outputs, self._ready = self._ready, []
        for i, rep in enumerate(self.replicas):
            if not rep.inline and self._assigned[i] and i not in self._polls:
                self._polls[i] = rep.poll(timeout_s)
        inline_busy = False
        for i, rep in enumerate(self.replicas):
            if rep.inline and self._assigned[i]:
                outputs += self._result(i, lambda rep=rep: rep.step(timeout_s))
                inline_busy = True
        # block on the remote replicas only when no inline engine has work: an inline engine advances only
        # while this thread steps it, so waiting here would idle it
        if not outputs and not inline_busy and self._polls and not any(f.done() for f in self._polls.values()):
            concurrent.futures.wait(list(self._polls.values()), timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for i in [i for i, f in self._polls.items() if f.done()]:
            outputs += self._result(i, self._polls.pop(i).result)
        self._retire(outputs)
        self._dispatch()
        return outputs

    def interrupt(self) -> list[GenOutput]:
        queued = [GenOutput(r.request_id, [], [], [], "abort") for r in self._queue]
        for r in self._queue:
            self._where.pop(r.request_id, None)
        self._queue.clear()
        busy = [i for i in range(len(self.replicas)) if self._assigned[i]]
        futures = {i: self.replicas[i].call("interrupt") for i in busy}
        self._settle()
        outputs, self._ready = self._ready + queued, []
        for i, fut in futures.items():
            outputs += self._result(i, fut.result)
        self._retire(outputs)
        return outputs

    def update_weights(self, named_tensors: Any, version: int) -> None:
        """Every replica loads the same tensors (a dict, pairs, or a Ray ObjectRef of a dict)."""
        if self.num_in_flight() and not self.keeps_in_flight:
            raise RuntimeError("EnginePool.update_weights() with requests in flight: interrupt() or drain first")
        own = self.replicas[:self.own]   # lent replicas load their owner's weights in their owner's process
        ref, local = _share(named_tensors, any(not r.in_process for r in own), any(r.in_process for r in own))
        self._settle()
        futures = [(i, rep.call("update_weights", local if rep.in_process else ref, version))
                   for i, rep in enumerate(own)]
        self._loaded(version, [self._result(i, fut.result) for i, fut in futures])

    def sleep(self, level: int = 1, keep_in_flight: bool = False) -> None:
        """keep_in_flight: the requests stay in flight through the sleep (engines that swap them: `swaps_in_flight`)."""
        if keep_in_flight:
            self._all("sleep", level, True)
        else:
            self._all("sleep", level)

    def keeps_resident(self) -> bool:
        """Does every replica keep its memory through the next sleep (free_cache_engine=false, or what fits)?"""
        return all(self._all("keeps_resident"))

    @property
    def swaps_in_flight(self) -> bool:
        return all(self._all("swaps_in_flight"))

    def memory_report(self) -> dict[str, float]:
        """The replicas' memory metrics: bytes summed, flags and times at their largest."""
        out: dict[str, float] = {}
        for report in self._all("memory_report"):
            for key, value in (report or {}).items():
                out[key] = out.get(key, 0.0) + value if key.endswith("_gib") else max(out.get(key, 0.0), value)
        return out

    def wake_up(self) -> None:
        self._all("wake_up")

    def hold(self) -> None:
        """Engines in their own driver threads stop advancing their requests (kept in flight, KV cache kept) until
        `release()`; engines in this thread advance only when collect() runs anyway."""
        self._all("hold")

    def release(self) -> None:
        self._all("release")

    def load_everywhere(self, command: str, version: int) -> None:
        """Run a replica-side loading command (e.g. sync mode's 'load_trainer_weights') on all, then stamp."""
        self._loaded(version, self._all(command, version))

    # ------------------------------------------------------------------ lent replicas
    def join(self, replicas: list[Any]) -> list[int]:
        """Lent replicas (named handles, see replica.py) take requests from now on; a replica lent before (the same
        name) comes back at its old index.  Returns their indices."""
        indices = []
        for rep in replicas:
            i = self._lent.get(rep.name)
            if i is None:
                i = self._lent[rep.name] = len(self.replicas)
                self.replicas.append(rep)
                self.active.append(False)
                self._assigned.append(set())
                self.tokens.append(0)
                self.finished.append(0)
                self.busy_s.append(0.0)
                self._busy_since.append(None)
                self.timelines.append(Timeline(f"engine_{i}", self._timeline_on))
            self.active[i] = True
            indices.append(i)
        self._dispatch()
        return indices

    def leave(self, indices: list[int]) -> list[GenOutput]:
        """Lent replicas stop taking requests and hand back what they hold: outputs they finished and the partial
        (aborted) outputs of the rest, with any outputs of other replicas already gathered."""
        for i in indices:
            self.active[i] = False
        self._settle()
        outputs, self._ready = self._ready, []
        futures = {i: self.replicas[i].call("interrupt") for i in indices if self._assigned[i]}
        for i, fut in futures.items():
            outputs += self._result(i, fut.result)
        self._retire(outputs)
        for i in indices:   # a group whose home left goes to the least-loaded replica from now on
            for group in [g for g, (rep, _) in self._group_home.items() if rep == i]:
                del self._group_home[group]
        return outputs

    # ------------------------------------------------------------------ collective weight sync
    def weight_receivers(self) -> int:
        return sum(self._all("weight_receivers"))

    def init_weight_group(self, addr: str, port: int, first_rank: int, world: int) -> None:
        counts = self._all("weight_receivers")
        offsets = [first_rank + sum(counts[:i]) for i in range(len(counts))]
        self._concurrently("init_weight_group", [(addr, port, off, world) for off in offsets])

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> None:
        self._loaded(version, self._all("receive_weights", metas, buckets, dtype, version))

    # ------------------------------------------------------------------ observability
    def engine_stats(self) -> list[dict[str, float]]:
        """Per replica, cumulative: tokens generated, seconds it had work (the pool's view), and the engine's
        own iterations, seconds inside them and tokens cached over its decode steps (a remote replica's as of its
        last poll); and its slots (max_num_seqs, as the run resolved it)."""
        now = time.perf_counter()
        stats = []
        for i, rep in enumerate(self.replicas):
            counters = getattr(rep, "counters", None)
            busy = self.busy_s[i] + (now - self._busy_since[i] if self._busy_since[i] is not None else 0.0)
            stats.append({"tokens": self.tokens[i], "busy_s": busy, "finished": self.finished[i],
                          "iterations": counters.iterations if counters else 0,
                          "engine_s": counters.engine_s if counters else 0.0,
                          "kv_tokens": counters.kv_tokens if counters else 0, "slots": self.max_num_seqs})
        return stats

    def drain_timeline(self) -> list[dict]:
        return [e for t in self.timelines for e in t.drain()]

    # ------------------------------------------------------------------ internals
    def _room(self, i: int) -> int:
        return self.max_num_seqs - len(self._assigned[i])

    def _choose(self, req: GenRequest) -> Optional[int]:
        home = self._group_home.get(req.group_id) if req.group_id else None
        if home is not None and self.active[home[0]] and self._room(home[0]) > 0:
            return home[0]
        free = [i for i in range(len(self.replicas)) if self.active[i] and self._room(i) > 0]
        return min(free, key=lambda i: (len(self._assigned[i]), i)) if free else None

    def _dispatch(self) -> None:
        batches: dict[int, list[GenRequest]] = {}
        while self._queue:
            i = self._choose(self._queue[0])
            if i is None:
                break
            req = self._queue.popleft()
            batches.setdefault(i, []).append(req)
            self._assigned[i].add(req.request_id)
            self._where[req.request_id] = (i, req.group_id)
            if req.group_id:
                rep, count = self._group_home.get(req.group_id, (i, 0))
                self._group_home[req.group_id] = (rep, count + 1) if rep == i else (i, 1)
            if self._busy_since[i] is None:
                self._busy_since[i] = time.perf_counter()
        for i, reqs in batches.items():
            self.replicas[i].submit(reqs)

    def _retire(self, outputs: list[GenOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            where = self._where.pop(out.request_id, None)
            if where is None:
                continue  # a queued request aborted before dispatch
            i, group = where
            self._assigned[i].discard(out.request_id)
            self.tokens[i] += len(out.token_ids)
            self.finished[i] += out.finish_reason != "abort"
            home = self._group_home.get(group)
            if home is not None:
                if home[1] <= 1:
                    del self._group_home[group]
                else:
                    self._group_home[group] = (home[0], home[1] - 1)
            if not self._assigned[i] and self._busy_since[i] is not None:
                start = self._busy_since[i]
                self.busy_s[i] += now - start
                self.timelines[i].add("generate", _wall_us(start, now), (now - start) * 1e6)
                self._busy_since[i] = None

    def _settle(self) -> None:
        """Wait for outstanding polls; their outputs are handed out by the next collect/interrupt."""
        for i, fut in list(self._polls.items()):
            self._ready += self._result(i, fut.result)
        self._polls.clear()

    def _result(self, i: int, get: Any) -> Any:
        try:
            return get()
        except Exception as exc:  # noqa: BLE001 - named, with the replica's root cause
            from fully_async.cluster.ray_utils import describe

            raise ReplicaFailed(f"rollout engine replica {i} ({self.replicas[i].name}) failed: "
                                f"{describe(exc)}") from exc

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._concurrently(method, [args] * self.own)

    def _concurrently(self, method: str, per_replica: list[tuple]) -> list[Any]:
        """Call every own replica (lent ones are their owner's to command), remote ones first so inline ones cannot
        block a rendezvous."""
        self._settle()
        order = sorted(range(self.own), key=lambda i: self.replicas[i].inline)
        futures = {}
        for i in order:
            futures[i] = self.replicas[i].call(method, *per_replica[i])
        return [self._result(i, futures[i].result) for i in range(self.own)]

    def _loaded(self, version: int, timings: list[dict[str, float]]) -> None:
        """Every replica loaded `version`; the slowest replica's timing of each phase is the pool's."""
        self.last_update_timings = {k: max(t.get(k, 0.0) for t in timings) for t in timings for k in t}
        self.version = version


def _wall_us(start_perf: float, now_perf: float) -> float:
    """Wall-clock microseconds of a perf_counter instant (timeline events use wall time)."""
    return (time.time() - (now_perf - start_perf)) * 1e6


def _share(named_tensors: Any, remote: bool, inline: bool) -> tuple[Any, Any]:
    """(what remote replicas get, what inline replicas get): one object-store copy for all remotes (a device-IPC
    handle, or the handles of every trainer rank, goes to both as it is: each opens it where its engine runs)."""
    from fully_async.weight_sync.device_ipc import SharedWeights, SharedWeightsByDevice

    if isinstance(named_tensors, (SharedWeights, SharedWeightsByDevice)):
        return named_tensors, named_tensors
    try:
        import ray
        is_ref = isinstance(named_tensors, ray.ObjectRef)
    except ImportError:
        ray, is_ref = None, False
    if is_ref:
        return named_tensors, (ray.get(named_tensors) if inline else None)
    if not remote:
        return None, named_tensors
    tensors = dict(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
    return ray.put(tensors), tensors
