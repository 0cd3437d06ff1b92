"""The launcher both modes share (layer 5): prepare, start Ray, create actors, supervise, finish.

Supervision is where "no hangs, no silent failures" lives:
  * every actor's run() is awaited together; the first failure stops everything and the run exits
    non-zero naming the actor and its root cause (ray_utils.supervise);
  * a watchdog fails the run, with the queue/counter/in-flight state, when neither side made
    progress for trainer.progress_timeout_s;
  * SIGTERM/SIGINT ask the trainer to finish its step and checkpoint, then the run exits 128+signal;
  * checkpoints: when the main actor asks for one (its run() waits), the driver has every actor write its
    own part into one temporary folder and renames it when all are in (`take_checkpoint`);
  * resume: the newest checkpoint (trainer.resume_mode) is handed to every actor, which loads its own
    part -- trainer, data position, queue, in-flight partial responses -- and the engine receives the
    restored weights before generating.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable, Optional

from fully_async.core.plan import RunPlan

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
        from fully_async.cluster.ray_utils import RunFailed

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

    def touch(self) -> None:
        """Something the counters do not show made progress (a checkpoint the driver itself took)."""
        self.last_change = time.monotonic()


def take_checkpoint(trainer_cfg: Any, actors: dict, main_actor: str, version: int,
                    get: Callable[[Any], Any]) -> str:
    """The driver's side of the checkpoint the main actor asked for (its run() waits meanwhile): every actor
    writes its own part into one temporary folder, which becomes global_step_<version> by a rename once all
    parts are in (checkpoint.py).  The rollouter holds from its part until the queue's is written, so the
    two are one cut; it generates again while the trainer writes its (larger) part.  `get`: ray.get."""
    from fully_async.core.checkpoint import begin_checkpoint, commit_checkpoint

    tmp = begin_checkpoint(trainer_cfg.default_local_dir, version)
    rollouter = actors.get("rollouter")
    if rollouter is not None:
        get(rollouter.save_part.remote(tmp))
        try:
            if "queue" in actors:
                get(actors["queue"].save_part.remote(tmp))
        finally:
            get(rollouter.release.remote())
    get(actors[main_actor].save_part.remote(tmp))
    return commit_checkpoint(trainer_cfg.default_local_dir, version, tmp, keep=trainer_cfg.max_ckpt_to_keep)


def serve_checkpoint(trainer_cfg: Any, actors: dict, main_actor: str) -> bool:
    """Take the checkpoint the main actor waits for, if any; True when one was taken."""
    import ray

    from fully_async.cluster.ray_utils import RunFailed, is_secondary, root_cause

    main = actors[main_actor]
    version = ray.get(main.checkpoint_wanted.remote())
    if version is None:
        return False
    try:
        path = take_checkpoint(trainer_cfg, actors, main_actor, version, ray.get)
    except Exception as exc:  # noqa: BLE001
        if is_secondary(exc):
            raise  # an actor died: supervise() reports its own error
        cause = root_cause(exc)
        raise RunFailed(f"checkpoint global_step_{version} failed: {type(cause).__name__}: {cause}") from None
    ray.get(main.checkpoint_done.remote(path))
    return True


def launch(cfg: Any, create: Callable[..., dict], main_actor: str) -> dict:
    """`create(prep, device, resume_path)` returns named actor handles, each loading its own part of the
    checkpoint at resume_path; `main_actor` has run()/pop_metrics()/validate()/request_stop()/
    checkpoint_wanted(); others with run() run beside it and are stopped.  Every actor with a part of the
    checkpoint has save_part(folder)."""
    import ray

    from fully_async.core.checkpoint import find_resume_path
    from fully_async.core.device import check_available, describe_hardware, get_device
    from fully_async.core.metrics import tensorboard_dir
    from fully_async.cluster.placement import release_placement_groups
    from fully_async.run.prepare import prepare
    from fully_async.cluster.ray_utils import RunFailed, check_resources, kill_all, start_ray, supervise, wait_ready
    from fully_async.run.run_logging import RunLogger

    t_start = time.perf_counter()
    prep = prepare(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    resume_path = find_resume_path(cfg.trainer)
    if resume_path:
        logger.info("resuming from %s", resume_path)
    plan = RunPlan.of(cfg)
    started_ray = start_ray(num_cpus_needed=max(2, plan.total_devices),  # one core per actor on CPU
                            env_vars=device.runtime_env_vars())
    actors: dict = {}
    signals: list[int] = []
    old_handlers = {s: signal.signal(s, lambda signum, _f: signals.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        needs = {"trainer": plan.trainer_devices}
        if plan.rollout_devices:
            needs["rollout"] = plan.rollout_devices
        check_resources(device, needs)
        actors = create(prep, device, resume_path)
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
            if serve_checkpoint(cfg.trainer, actors, main_actor):
                watchdog.touch()  # the driver was busy with it: the counters had no chance to move
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

    from fully_async.core.timeline import write_trace

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
