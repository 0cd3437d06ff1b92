"""A scripted, deterministic `RolloutEngine` (pure Python: no torch, no Ray) and a threaded replica of it.

Every prompt in these tests is PROMPT_LEN tokens long.  The token at absolute position p of a sample is
a pure function of (sample id, p), and a sample's natural length (before EOS) is a pure function of its
id, so a response interrupted and resumed on the prompt + partial prefix continues exactly as it would
have without the interruption: tests compare a resumed run to an uninterrupted one token for token.
Log-probs encode the version that sampled the token (-0.1 * (version + 1)).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
from collections import deque
from typing import Any, Callable, Optional

from fully_async.rollout.engines.replica import EngineDriver, engine_command
from fully_async.core.types import GenOutput, GenRequest, PromptRecord

PROMPT_LEN = 3
EOS = 1


def _h(*parts: Any) -> int:
    return int(hashlib.md5("/".join(map(str, parts)).encode()).hexdigest()[:8], 16)


def natural_length(sample_id: str, max_len: int = 12) -> int:
    return 1 + _h("len", sample_id) % max_len


def token_at(sample_id: str, position: int) -> int:
    return 2 + _h("tok", sample_id, position) % 40


def records(count: int) -> list[PromptRecord]:
    return [PromptRecord(i, [10 + i % 7, 20, 30][:PROMPT_LEN], "fake", "") for i in range(count)]


class ScriptedEngine:
    def __init__(self, max_num_seqs: int = 4, keeps_in_flight: bool = False, max_len: int = 12,
                 fixed_len: Optional[int] = None):
        self.max_num_seqs = max_num_seqs
        self.fixed_len = fixed_len          # every response this long (instead of natural_length)
        self.served: list[str] = []
        self.keeps_in_flight = keeps_in_flight
        self.max_len = max_len
        self.version = 0
        self.waiting: deque = deque()
        self.running: dict[str, list] = {}   # request id -> [request, tokens, log_probs, versions]
        self.steps = 0
        self.loads: list[int] = []
        self.asleep = False
        self.last_update_timings: dict = {}

    def submit(self, requests: list[GenRequest]) -> None:
        if self.asleep:
            raise RuntimeError("submit while asleep")
        for r in requests:
            self.waiting.append(r)

    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def collect(self, timeout_s: float = 0.05) -> list[GenOutput]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            self.running[r.request_id] = [r, [], [], []]
        self.steps += 1
        done = []
        for rid, (req, toks, lps, vers) in list(self.running.items()):
            pos = len(req.prompt_ids) + len(toks)
            generated = pos - PROMPT_LEN  # response tokens so far, partial prefix included
            length = self.fixed_len or natural_length(rid, self.max_len)
            tok = EOS if generated + 1 >= length else token_at(rid, pos)
            toks.append(tok)
            lps.append(-0.1 * (self.version + 1))
            vers.append(self.version)
            if tok == EOS or len(toks) >= req.params.max_tokens:
                done.append(GenOutput(rid, toks, lps, vers, "stop" if tok == EOS else "length"))
                self.served.append(rid)
                del self.running[rid]
        return done

    def interrupt(self) -> list[GenOutput]:
        out = [GenOutput(rid, t, lp, v, "abort") for rid, (_, t, lp, v) in self.running.items()]
        out += [GenOutput(r.request_id, [], [], [], "abort") for r in self.waiting]
        self.running, self.waiting = {}, deque()
        return out

    def update_weights(self, named_tensors: Any, version: int) -> None:
        if self.num_in_flight() and not self.keeps_in_flight:
            raise RuntimeError("update_weights with requests in flight")
        self.loads.append(version)
        self.version = version

    def sleep(self, level: int = 1) -> None:
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False


def expected_response(sample_id: str, max_tokens: int, max_len: int = 12) -> list[int]:
    """What an uninterrupted run of ScriptedEngine produces for this sample."""
    out = []
    for k in range(max_tokens):
        if k + 1 >= natural_length(sample_id, max_len):
            return out + [EOS]
        out.append(token_at(sample_id, PROMPT_LEN + k))
    return out


class ThreadReplica:
    """RemoteReplica's behaviour without Ray: the engine runs in an EngineDriver thread."""

    inline = False
    in_process = True

    def __init__(self, engine: Any, name: str):
        self.engine = engine
        self.name = name
        self.driver = EngineDriver(engine, name)
        self.pool_exec = concurrent.futures.ThreadPoolExecutor(1)  # one call at a time, in order, like an actor

    def submit(self, requests: list[GenRequest]) -> None:
        self.pool_exec.submit(self.driver.submit, requests)

    def poll(self, timeout_s: float) -> concurrent.futures.Future:
        return self.pool_exec.submit(self.driver.poll, timeout_s)

    @property
    def counters(self):
        return self.driver.counters

    def call(self, method: str, *args: Any) -> concurrent.futures.Future:
        if method == "interrupt":
            return self.pool_exec.submit(self.driver.interrupt)
        if method in ("hold", "release"):
            return self.pool_exec.submit(lambda: self.driver.hold(method == "hold").result())
        return self.pool_exec.submit(
            lambda: self.driver.call(lambda e: engine_command(e, None, method, args)).result())

    def close(self) -> None:
        self.driver.close()
        self.pool_exec.shutdown()


def run_until(cond: Callable[[], bool], step: Callable[[], Any], limit: int = 100000) -> None:
    for _ in range(limit):
        if cond():
            return
        step()
    raise AssertionError("condition not reached")


def make_lengths(target: Callable[[str], Optional[int]]) -> Any:
    class _L:
        def target(self, sid: str) -> Optional[int]:
            return target(sid)
    return _L()


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeQueue:
    """The GroupQueue class behind `.method.remote(...)` calls, without Ray."""

    def __init__(self):
        from fully_async.actors.queue import GroupQueue
        self.q = GroupQueue()

    def __getattr__(self, name):
        return Remote(getattr(self.q, name))
