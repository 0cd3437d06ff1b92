"""The launcher both modes share (layer 7): prepare, start Ray, create actors, supervise, finish.

Supervision is where "no hangs, no silent failures" lives:
  * every actor's run() is awaited together; the first failure stops everything and the run exits
    non-zero naming the actor and its root cause (ray_utils.supervise);
  * a watchdog fails the run, with the queue/counter/in-flight state, when neither side made
    progress for trainer.progress_timeout_s;
  * SIGTERM/SIGINT/SIGHUP ask the trainer to finish its step and checkpoint (an emergency one when
    trainer.save_freq=-1), then the run exits 128+signal; during start-up (checks, Ray, actor creation) they stop it
    at once: one line, Ray shut down, exit 128+signal.  Ray's own processes run in a session of their own
    (cluster/ray_utils.ray_processes_in_own_session), so a signal to the job's whole process group (a scheduler,
    `timeout`, `kill -- -PGID`, a closed terminal) reaches only the driver, which stops the run and then Ray;
  * one run per folder: a lock in trainer.default_local_dir (and the TensorBoard run dir) is taken before
    anything else and released at exit (run_lock.py);
  * checkpoints: when the main actor asks for one (its run() waits), the driver has every actor write its
    own part into one temporary folder and renames it when all are in (`take_checkpoint`);
  * resume: the newest intact checkpoint (trainer.resume_mode; its manifest verified, its saved config
    compared with this run's) is handed to every actor, which loads its own
    part -- trainer, data position, queue, in-flight partial responses -- and the engine receives the
    restored weights before generating.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any, Callable, Iterator, Optional

from fully_async.core.config import validation_only
from fully_async.core.plan import RunPlan
from fully_async.run.watchdog import Watchdog, run_watchdog
from fully_async.core.workload import RESPONSE_LENGTHS, length_histogram

logger = logging.getLogger("fully_async")


class RunInterrupted(RuntimeError):
    def __init__(self, signum: int, checkpoint: Optional[str], starting: bool = False):
        if starting:
            super().__init__(f"interrupted by {signal.Signals(signum).name} during start-up; nothing was trained")
        else:
            super().__init__(f"interrupted by {signal.Signals(signum).name}; checkpoint: {checkpoint}" if checkpoint
                             else f"interrupted by {signal.Signals(signum).name}; nothing was saved (no checkpoint)")
        self.signum = signum


class StartInterrupted(BaseException):
    """Raised by the signal handler during start-up; a BaseException so that no library's `except Exception`
    catches or rewraps it on its way out; launch turns it into RunInterrupted."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# a scheduler's stop or preemption, `timeout`, Ctrl-C, a closed terminal: each ends the run with a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _detach_from_terminal() -> None:
    """SIGHUP: the terminal is gone, and a write to it would fail (EIO) while the run saves its checkpoint; the
    console goes to /dev/null from here (Hydra's main.log keeps every line)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)


class _Signals:
    """SIGTERM/SIGINT/SIGHUP while starting stop the run: during the driver's own checks (lock, data, checkpoint
    verification) the handler raises StartInterrupted where the driver is; from ray.init until the actors are
    ready it only records the signal and `check()` raises at the next stage or wait tick.  Either way it
    unwinds through launch's cleanup (Ray shut down, locks released).  Once running, signals are recorded for
    the supervision loop, which asks for a graceful stop.  A second signal during the unwinding is only
    recorded."""

    def __init__(self):
        self.received: list[int] = []
        self.starting = True
        self.defer = False  # record only, from ray.init to the actors being ready (check() stops there):
        #                     an exception raised inside Ray (its at-fork hooks, a blocking call in C) would be
        #                     swallowed or turned into another error
        self.start_signal: Optional[int] = None
        self.old = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        self.old_unraisable = sys.unraisablehook
        sys.unraisablehook = self.unraisable

    def unraisable(self, info: Any) -> None:
        """Our exception, raised where Python can only print it (e.g. in an at-fork hook of ray.init's
        subprocesses): not printed; check() raises it at the next stage."""
        if not isinstance(info.exc_value, StartInterrupted):
            self.old_unraisable(info)

    def reinstall(self) -> None:
        """ray.init installs its own SIGTERM handler (sys.exit(signum)): put ours back."""
        for s in self.old:
            signal.signal(s, self.handle)

    def handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        first = not self.received
        self.received.append(signum)
        if self.starting and first:
            self.start_signal = signum
        if self.starting and first and not self.defer:
            raise StartInterrupted(signum)

    def check(self) -> None:
        """Between start-up stages: a signal whose exception was swallowed (it landed in a callback whose
        exceptions Python ignores, e.g. an at-fork hook) stops the run here."""
        if self.starting and self.received:
            raise StartInterrupted(self.received[0])

    def running(self) -> None:
        self.check()
        self.starting = False

    def restore(self) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)
        sys.unraisablehook = self.old_unraisable


def run_locks(cfg: Any) -> list:
    """The locks of the folders this run writes: its checkpoints and, when written, its TensorBoard dir."""
    from fully_async.telemetry.metrics import tensorboard_dir
    from fully_async.run.run_lock import acquire

    locks = [acquire(cfg.trainer.default_local_dir)]
    if "tensorboard" in cfg.trainer.logger or cfg.trainer.timeline:
        tb = tensorboard_dir(cfg.trainer.project_name, cfg.trainer.experiment_name)
        if os.path.realpath(tb) == os.path.realpath(cfg.trainer.default_local_dir):
            return locks   # one folder (TENSORBOARD_DIR = trainer.default_local_dir): its lock is this run's already
        try:
            locks.append(acquire(tb, "TensorBoard run dir (TENSORBOARD_DIR or trainer.project_name/experiment_name)"))
        except BaseException:
            locks[0].release()
            raise
    return locks


def own_tensorboard_dir(cfg: Any, teardown: Any) -> Optional[str]:
    """A new run (not resuming) whose TensorBoard dir holds an earlier run's event files writes into the next free
    `<dir>_<k>` instead (locked, named in the log, TENSORBOARD_DIR set for this run's writers and restored at the
    end), so TensorBoard shows it as a run of its own; returns that folder, or None when the dir is free."""
    from fully_async.run.run_lock import acquire
    from fully_async.run.run_logging import fresh_tensorboard_dir
    from fully_async.telemetry.metrics import tensorboard_dir

    if "tensorboard" not in cfg.trainer.logger and not cfg.trainer.timeline:
        return None
    tb = tensorboard_dir(cfg.trainer.project_name, cfg.trainer.experiment_name)
    fresh = fresh_tensorboard_dir(tb)
    if fresh is None:
        return None
    teardown.callback(acquire(fresh, "TensorBoard run dir (next free beside an earlier run's)").release)
    before = os.environ.get("TENSORBOARD_DIR")
    teardown.callback(lambda: os.environ.pop("TENSORBOARD_DIR", None) if before is None
                      else os.environ.__setitem__("TENSORBOARD_DIR", before))
    os.environ["TENSORBOARD_DIR"] = fresh
    logger.info("%s holds an earlier run's TensorBoard events: this run writes to %s, a run of its own (to continue "
                "a run's curves, resume it from a checkpoint: trainer.resume_mode=auto)", tb, fresh)
    return fresh


def config_dict(typed_cfg: Any) -> dict:
    """The resolved config as plain data (what a checkpoint stores as config.json)."""
    import dataclasses

    return dataclasses.asdict(typed_cfg)


def take_checkpoint(trainer_cfg: Any, actors: dict, main_actor: str, version: int,
                    get: Callable[[Any], Any], config: Optional[dict] = None) -> str:
    """The driver's side of the checkpoint the main actor asked for (its run() waits meanwhile): every actor
    writes its own part into one temporary folder, which becomes global_step_<version> by a rename once all
    parts are in (checkpoint.py), with `config` (the run's resolved config) and the manifest.  The rollouter
    holds from its part until the queue's is written, so the two are one cut; it generates again while the
    trainer writes its (larger) part.  `get`: ray.get."""
    from fully_async.core.checkpoint import CheckpointError, begin_checkpoint, commit_checkpoint
    from fully_async.core.checkpoint_space import abandon_checkpoint

    root = trainer_cfg.default_local_dir
    tmp = begin_checkpoint(root, version)
    try:
        rollouter = actors.get("rollouter")
        if rollouter is not None:
            get(rollouter.save_part.remote(tmp))
            try:
                if "queue" in actors:
                    get(actors["queue"].save_part.remote(tmp))
            finally:
                get(rollouter.release.remote())
        get(actors[main_actor].save_part.remote(tmp))
        t0 = time.perf_counter()
        path = commit_checkpoint(root, version, tmp, keep=trainer_cfg.max_ckpt_to_keep, config=config)
    except Exception as exc:
        full = abandon_checkpoint(root, version, tmp, exc)
        if full:
            raise CheckpointError(full) from exc
        raise
    logger.debug("checkpoint manifest and commit of %s took %.2fs", path, time.perf_counter() - t0)
    return path


def serve_checkpoint(trainer_cfg: Any, actors: dict, main_actor: str, config: Optional[dict] = None,
                     calls: Any = None, deadline_s: Optional[float] = None) -> bool:
    """Take the checkpoint the main actor waits for, if any; True when one was taken.  Asking costs at most a
    moment (an unanswered ask is looked at again next tick, `Calls`); each part of the checkpoint and its commit
    are waited on at most `deadline_s` (trainer.progress_timeout_s)."""
    import ray

    from fully_async.cluster.ray_utils import Calls, RunFailed, describe, failure_traceback, is_secondary, root_cause

    calls = calls if calls is not None else Calls()
    main = actors[main_actor]
    done, version = calls.poll(f"{main_actor}.checkpoint_wanted", main.checkpoint_wanted.remote, 0.1)
    if not done or version is None:
        return False

    def get(ref: Any) -> Any:
        return ray.get(ref, timeout=deadline_s)

    try:
        path = take_checkpoint(trainer_cfg, actors, main_actor, version, get, config)
    except Exception as exc:  # noqa: BLE001
        if is_secondary(exc):
            raise  # an actor died: supervise() reports its own error
        cause = root_cause(exc)
        if isinstance(cause, ray.exceptions.GetTimeoutError):
            raise RunFailed(f"checkpoint global_step_{version} failed: an actor did not write its part within "
                            f"{deadline_s:g}s (trainer.progress_timeout_s); states: not saved") from None
        raise RunFailed(f"checkpoint global_step_{version} failed: {describe(exc)}",
                        failure_traceback(exc)) from None
    calls.get(f"{main_actor}.checkpoint_done", lambda: main.checkpoint_done.remote(path), deadline_s or 60.0)
    return True


class _Teardown(contextlib.ExitStack):
    """The run's resources, each released in reverse order of acquisition however the run ends (a finished run, a
    failure, a signal); `on_error` adds what only a failing run does.  From its first step on, a signal is only
    recorded."""

    def __init__(self, sig: _Signals):
        super().__init__()
        self.sig = sig

    def on_error(self, fn: Callable[[BaseException], Any]) -> None:
        def unwinding(exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
            if exc is not None:
                fn(exc)
            return False
        self.push(unwinding)

    def __exit__(self, *exc_info: Any) -> bool:
        self.sig.starting = False
        return super().__exit__(*exc_info)


@contextlib.contextmanager
def _ray_session(cfg: Any, sig: _Signals, plan: RunPlan, device: Any) -> Iterator[None]:
    """Join or start Ray for this run; a Ray this run started (or began to start) is shut down at the end.  From
    ray.init until the actors are ready a signal is only recorded (sig.defer): an exception raised inside Ray (its
    at-fork hooks, a blocking call in C) would be swallowed or turned into another error."""
    import ray

    from fully_async.cluster.ray_utils import start_ray

    ray_was_up = ray.is_initialized()
    started = False
    sig.defer = True
    try:
        if cfg.multi_job.pool is not None:
            from fully_async.placement.shared_pool import pool_ray_args

            where = pool_ray_args(cfg)
        else:
            where = {"address": cfg.multi_job.ray_address}
        try:
            started = start_ray(num_cpus_needed=max(2, plan.total_devices),  # one core per actor on CPU
                                env_vars=device.runtime_env_vars(), accelerator=device.ray_resource, **where)
        except SystemExit as exc:  # ray.init's own SIGTERM handler fired while it was starting
            if exc.code == signal.SIGTERM:
                raise StartInterrupted(signal.SIGTERM) from None
            raise
        sig.reinstall()
        sig.check()
        yield
    finally:
        if started or not ray_was_up:   # (also when ray.init was interrupted)
            ray.shutdown()


def filtered_groups(cfg: Any, actor: Any) -> list[str]:
    """The groups dynamic sampling dropped (algorithm.filter_groups; the rollouter's or the sync worker's count):
    with the trained samples they account for every prompt the run generated."""
    import ray

    if not cfg.algorithm.filter_groups.enable:
        return []
    return ray.get(actor.filtered_groups.remote())


def _release_actors(cfg: Any, actors: dict) -> None:
    """The actors' timelines (trainer.timeline), then the actors and their placement groups (a Ray session shared
    with the caller gets its resources back)."""
    from fully_async.placement.groups import release_placement_groups
    from fully_async.cluster.ray_utils import kill_all
    from fully_async.telemetry.metrics import tensorboard_dir

    if cfg.trainer.timeline and actors:
        write_timeline(actors, tensorboard_dir(cfg.trainer.project_name, cfg.trainer.experiment_name))
    kill_all(list(actors.values()))
    release_placement_groups()


def launch(cfg: Any, create: Callable[..., dict], main_actor: str) -> dict:
    """`create(prep, device, resume_path)` returns named actor handles, each loading its own part of the
    checkpoint at resume_path; `main_actor` has run()/pop_metrics()/validate()/request_stop()/
    checkpoint_wanted(); others with run() run beside it and are stopped.  Every actor with a part of the
    checkpoint has save_part(folder)."""
    t_start = time.perf_counter()
    sig = _Signals()  # from here a signal ends the run cleanly (start-up) or gracefully (running)
    try:
        with _Teardown(sig) as teardown:
            return _run(cfg, create, main_actor, sig, teardown, t_start)
    except StartInterrupted as exc:
        raise RunInterrupted(exc.signum, None, starting=True) from None
    except BaseException:
        if sig.start_signal is not None:  # whatever a signal interrupted during start-up, it is the story
            raise RunInterrupted(sig.start_signal, None, starting=True) from None
        raise
    finally:
        sig.restore()


def _run(cfg: Any, create: Callable[..., dict], main_actor: str, sig: _Signals, teardown: _Teardown,
         t_start: float) -> dict:
    """Start-up (checks, locks, data, Ray, actors), supervision, finish; every resource goes to `teardown` as it is
    taken.  Ray and torch (fully_async.device) are imported after the config and data checks: a refused config
    costs neither."""
    from fully_async.core.checkpoint import (check_resume_config, check_resume_state, checkpoint_version,
                                             find_resume_path, retire_abandoned)
    from fully_async.run.prepare import prepare
    from fully_async.cluster.ray_utils import (RunFailed, check_cpu_devices, check_resources, kill_all, supervise,
                                               wait_ready)
    from fully_async.run.run_logging import RunLogger, open_metric_logger

    shared = cfg.multi_job.pool is not None
    if shared:  # a shared pool: its checks come before the lock and the data (cheap, and the likeliest mistakes)
        from fully_async.placement.device_pool import check_reachable
        from fully_async.core.config_checks import validate
        from fully_async.placement.shared_pool import join_pool, leave_pool

        validate(cfg)
        check_reachable(cfg.multi_job.ray_address or os.environ["RAY_ADDRESS"])
    for lock in run_locks(cfg):
        teardown.callback(lock.release)
    prep = prepare(cfg)
    sig.check()
    from fully_async.device import check_available, describe_hardware, get_device

    device = get_device(cfg.trainer.device)
    check_available(device)
    resume_path = find_resume_path(cfg.trainer)
    saved_config = config_dict(prep.cfg)
    resumed_at = 0   # the checkpoint's step, resuming
    if resume_path:
        check_resume_config(resume_path, saved_config, cfg.trainer.resume_allow_config_change)
        resumed_at = check_resume_state(resume_path, cfg.mode, prep.total_steps, trains=not validation_only(cfg))
        logger.info("resuming from %s", resume_path)
    if resume_path is None:   # a new run: its own TensorBoard run, never another run's events overlaid
        own_tensorboard_dir(cfg, teardown)
    # the timeline trained from here: newer checkpoints (another timeline) leave retention's and auto's sight; a
    # validation-only run trains no timeline and leaves every checkpoint where it is
    if not validation_only(cfg):
        retire_abandoned(cfg.trainer.default_local_dir, checkpoint_version(resume_path) if resume_path else 0)
    plan = RunPlan.of(cfg)
    needs = {"trainer": plan.trainer_devices, **({"rollout": plan.rollout_devices} if plan.rollout_devices else {})}
    if not device.is_accelerator and not shared and not (cfg.multi_job.ray_address or os.environ.get("RAY_ADDRESS")):
        check_cpu_devices(needs)  # the Ray this run starts has as many CPUs as it is told: check before
    sink = open_metric_logger(cfg, resuming=resume_path is not None)  # a tracker that cannot start fails here
    teardown.on_error(lambda exc: sink.close(failed=not isinstance(exc, (RunInterrupted, StartInterrupted))))
    sig.check()
    teardown.enter_context(_ray_session(cfg, sig, plan, device))
    from fully_async.placement import placement_of

    if shared:
        teardown.callback(leave_pool, join_pool(cfg, device))
    elif placement_of(cfg).private_pool:   # colocated async: a private pool of the trainer's devices
        from fully_async.placement.shared_pool import colocate, leave_pool

        check_resources(device, {"trainer": plan.trainer_devices})
        teardown.callback(leave_pool, colocate(prep.cfg, device))
    else:
        check_resources(device, needs)
    actors: dict = {}
    teardown.callback(_release_actors, cfg, actors)   # also what a create that failed half-way made
    teardown.on_error(lambda exc: isinstance(exc, RunFailed) and kill_all(list(actors.values())))
    watchdog = run_watchdog(actors, cfg.trainer.progress_timeout_s)   # every actor watched from its creation (its constructor included)
    actors.update(create(prep, device, resume_path))
    sig.check()
    runners = {name: a for name, a in actors.items() if name != "queue"}
    watchdog.beating = tuple(runners)

    def starting() -> None:
        sig.check()
        watchdog.check_start()

    logger.info("actors ready in %.1fs on %s", wait_ready(runners, on_tick=starting), device.name)
    sig.defer = False
    sig.running()  # a signal from now on: finish the step, checkpoint, exit
    main = actors[main_actor]
    if cfg.mode == "async" and (resume_path or cfg.actor_rollout_ref.rollout.load_format == "dummy"):
        # the engine must generate with these weights; a trainer that stalls here is named by the watchdog
        supervise({main.sync_initial_weights.remote(): main_actor}, until=main_actor, on_tick=watchdog.check)
    # every running actor reports its own metrics (async: the trainer its steps, the rollouter its validations)
    run_log = RunLogger(cfg, prep.total_steps, list(runners.values()), hardware=describe_hardware(device), sink=sink,
                        names=list(runners), resumed_at=resumed_at)
    result = _supervise(cfg, actors, runners, main_actor, run_log, sig.received, saved_config,
                        validate_at=prep.total_steps if prep.val else None, watchdog=watchdog)
    lengths = result.get("response_lengths") if isinstance(result, dict) else None
    if lengths:   # the run's response lengths as a histogram file (plan.response_lengths / a benchmark replay)
        run_log.sink.write_json(RESPONSE_LENGTHS, length_histogram(lengths))
    summary = run_log.finish(time.perf_counter() - t_start)
    summary["trained_sample_ids"] = result.get("trained_sample_ids", []) if isinstance(result, dict) else []
    summary["filtered_group_uids"] = filtered_groups(cfg, actors.get("rollouter", main))
    if sig.received:
        raise RunInterrupted(sig.received[0], result.get("checkpoint") if isinstance(result, dict) else None)
    return summary


def _supervise(cfg: Any, actors: dict, runners: dict, main_actor: str, run_log: Any, signals: list[int],
               saved_config: dict, validate_at: Optional[int], watchdog: Optional[Watchdog] = None) -> Any:
    """Run every actor until the main one returns (checkpoints, the stop on a signal, the watchdog on each tick),
    validate the final weights at step `validate_at` (unless validated there already), stop the others; the main
    actor's result."""
    from fully_async.cluster.ray_utils import supervise

    main = actors[main_actor]
    calls = run_log.calls  # every call from the driver: none waited on past its deadline
    deadline = cfg.trainer.progress_timeout_s  # for work an actor does (a checkpoint part, a validation)
    answer = min(60.0, deadline)  # for a call an actor only has to answer (stop, request_stop)
    if watchdog is None:
        watchdog = Watchdog(actors, cfg.trainer.progress_timeout_s)
    watchdog.calls = calls   # the queue too: a stopped queue is named, not only the sides waiting on it
    stop_sent = []

    def tick() -> None:
        run_log.drain()
        if serve_checkpoint(cfg.trainer, actors, main_actor, saved_config, calls, deadline):
            watchdog.touch()  # the driver was busy with it: the counters had no chance to move
        if signals and not stop_sent:
            logger.warning("%s received: finishing the current step and saving a checkpoint",
                           signal.Signals(signals[0]).name)
            calls.get(f"{main_actor}.request_stop", main.request_stop.remote, answer)
            stop_sent.append(True)
        watchdog.check()  # also while stopping: a side that stops answering then must not hang the exit

    runs = {a.run.remote(): name for name, a in runners.items()}
    helpers = {name: a for name, a in actors.items() if name not in runners}  # the queue: no run() of its own
    result = supervise(runs, until=main_actor, on_tick=tick, helpers=helpers)
    run_log.drain(deadline_s=answer)
    if isinstance(result, dict) and isinstance(result.get("steps"), int) and validate_at is not None:
        validate_at = result["steps"]   # the step the weights are from (a run whose data ended early included)
    if not signals and validate_at is not None and not run_log.has_val_at(validate_at):
        name = "rollouter" if "rollouter" in actors else main_actor
        val = calls.get(f"{name}.validate", actors[name].validate.remote, deadline)
        if isinstance(val, dict) and "rm_validation" in val:   # the trainer scores it with the reward model
            item = val["rm_validation"]
            val = calls.get(f"{main_actor}.score_validation", lambda: main.score_validation.remote(item), deadline)
        if val is not None:   # None: the rollouter validated these weights itself; they come with the last drain
            run_log.log_val(val, validate_at)
    others = {ref: name for ref, name in runs.items() if name != main_actor}
    for name in others.values():
        calls.get(f"{name}.stop", actors[name].stop.remote, answer)
    if others:
        supervise(others, until=next(iter(others.values())), on_tick=lambda: None, deadline_s=deadline)
    run_log.drain(deadline_s=answer)
    return result


def write_timeline(actors: dict, run_dir: str) -> None:
    import ray

    from fully_async.telemetry.timeline import write_trace

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
