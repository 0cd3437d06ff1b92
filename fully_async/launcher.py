"""The launcher both modes share (layer 4): prepare, start Ray, create actors, supervise, finish.

Supervision is where "no hangs, no silent failures" lives:
  * every actor's run() is awaited together; the first failure stops everything and the run exits
    non-zero naming the actor and its root cause (ray_utils.supervise);
  * a watchdog fails the run, with the queue/counter/in-flight state, when neither side made
    progress for trainer.progress_timeout_s;
  * SIGTERM/SIGINT ask the trainer to finish its step and checkpoint, then the run exits 128+signal;
  * resume: the newest checkpoint (trainer.resume_mode) restores trainer, data position, queue and
    in-flight partial responses, and the engine receives the restored weights before generating.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable, Optional

logger = logging.getLogger("fully_async")


class RunInterrupted(RuntimeError):
    def __init__(self, signum: int, checkpoint: Optional[str]):
        super().__init__(f"interrupted by {signal.Signals(signum).name}; checkpoint: {checkpoint or 'none'}")
        self.signum = signum


class Watchdog:
    """Fails the run when the progress counters of every actor stood still for `timeout_s`."""

    def __init__(self, actors: dict, timeout_s: float, poll_s: float = 5.0):
        self.actors = actors
        self.timeout_s = timeout_s
        self.poll_s = min(poll_s, timeout_s / 4)
        self.last_change = time.monotonic()
        self.last_poll = 0.0
        self.signature: Any = None

    def state(self) -> dict:
        import ray

        out = {}
        for name, handle in self.actors.items():
            try:
                out[name] = ray.get(handle.progress.remote(), timeout=5)
            except Exception as exc:  # noqa: BLE001 - an unresponsive actor is part of the report
                out[name] = f"not responding ({type(exc).__name__})"
        return out

    def check(self) -> None:
        from fully_async.ray_utils import RunFailed

        now = time.monotonic()
        if now - self.last_poll < self.poll_s:
            return
        self.last_poll = now
        state = self.state()
        signature = {n: {k: v for k, v in s.items() if k in ("step", "engine_steps", "validations")}
                     if isinstance(s, dict) else s for n, s in state.items()}
        if signature != self.signature:
            self.signature, self.last_change = signature, now
            return
        if now - self.last_change > self.timeout_s:
            raise RunFailed(f"no progress for {now - self.last_change:.0f}s (trainer.progress_timeout_s="
                            f"{self.timeout_s:g}); state: {state}")


def launch(cfg: Any, create: Callable[..., dict], main_actor: str) -> dict:
    """`create(prep, device, resume_path, resume_state)` returns named actor handles; `main_actor` has
    run()/pop_metrics()/validate()/request_stop(); others with run() run beside it and are stopped."""
    import ray

    from fully_async.checkpoint import find_resume_path, read_pickle
    from fully_async.device import check_available, describe_hardware, get_device
    from fully_async.metrics import tensorboard_dir
    from fully_async.placement import release_placement_groups
    from fully_async.prepare import prepare
    from fully_async.ray_utils import RunFailed, check_resources, kill_all, start_ray, supervise, wait_ready
    from fully_async.run_logging import RunLogger

    t_start = time.perf_counter()
    prep = prepare(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    resume_path = find_resume_path(cfg.trainer)
    resume_state = read_pickle(os.path.join(resume_path, "rollout_state.pkl")) if resume_path else None
    if resume_path:
        logger.info("resuming from %s", resume_path)
    n_train = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    n_roll = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node if cfg.mode == "async" else 0
    started_ray = start_ray(num_cpus_needed=max(2, n_train + n_roll))  # one core per actor on CPU
    actors: dict = {}
    signals: list[int] = []
    old_handlers = {s: signal.signal(s, lambda signum, _f: signals.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        needs = {"trainer": cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node}
        if cfg.mode == "async":
            needs["rollout"] = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
        check_resources(device, needs)
        actors = create(prep, device, resume_path, resume_state)
        runners = {name: a for name, a in actors.items() if name != "queue"}
        logger.info("actors ready in %.1fs on %s", wait_ready(runners), device.name)
        main = actors[main_actor]
        if cfg.mode == "async" and (resume_path or cfg.actor_rollout_ref.rollout.load_format == "dummy"):
            ray.get(main.sync_initial_weights.remote())  # the engine must generate with these weights
        # every running actor reports its own metrics (async: the trainer its steps, the rollouter its validations)
        run_log = RunLogger(cfg, prep.total_steps, list(runners.values()), hardware=describe_hardware(device))
        watchdog = Watchdog(runners, cfg.trainer.progress_timeout_s)
        stop_sent = []

        def tick() -> None:
            run_log.drain()
            if signals and not stop_sent:
                logger.warning("%s received: finishing the current step and saving a checkpoint",
                               signal.Signals(signals[0]).name)
                ray.get(main.request_stop.remote())
                stop_sent.append(True)
            if not stop_sent:
                watchdog.check()

        runs = {a.run.remote(): name for name, a in runners.items()}
        result = supervise(runs, until=main_actor, on_tick=tick)
        run_log.drain()
        if not signals:
            validator = actors.get("rollouter", main)
            if prep.val and not run_log.has_val_at(prep.total_steps):
                run_log.log_val(ray.get(validator.validate.remote()), prep.total_steps)
        others = {ref: name for ref, name in runs.items() if name != main_actor}
        for name in others.values():
            ray.get(actors[name].stop.remote())
        if others:
            supervise(others, until=next(iter(others.values())), on_tick=lambda: None)
        run_log.drain()
        summary = run_log.finish(time.perf_counter() - t_start)
        summary["trained_sample_ids"] = result.get("trained_sample_ids", []) if isinstance(result, dict) else []
        if signals:
            raise RunInterrupted(signals[0], result.get("checkpoint") if isinstance(result, dict) else None)
        return summary
    except RunFailed:
        kill_all(list(actors.values()))
        raise
    finally:
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        if cfg.trainer.timeline and actors:
            write_timeline(actors, tensorboard_dir(cfg.trainer.project_name, cfg.trainer.experiment_name))
        kill_all(list(actors.values()))  # a Ray session shared with the caller gets its resources back
        release_placement_groups()
        if started_ray:
            ray.shutdown()


def write_timeline(actors: dict, run_dir: str) -> None:
    import ray

    from fully_async.timeline import write_trace

    events: list[dict] = []
    for name, handle in actors.items():
        if name == "queue":
            continue
        try:
            events += ray.get(handle.get_timeline.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - a dead actor's spans are lost, the rest is written
            logger.warning("timeline of %s unavailable: %s", name, exc)
    path = os.path.join(run_dir, "timeline.json")
    write_trace(path, events)
    logger.info("timeline: %s (%d spans; open in ui.perfetto.dev)", path, len(events))
