"""Ray plumbing for the entry points (layer 2): start/join, resource checks, failure supervision."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """An actor failed; the message names the actor and its root cause.  `details`: the failing code's traceback
    where one is known (failure_traceback), which the entry point writes to a file beside the run's log instead of
    printing it."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class Unresponsive(RunFailed):
    """An actor did not answer the driver within the call's deadline."""


UNRESPONSIVE = "not responding (its process is stopped, wedged, or holds the GIL)"


class Calls:
    """The driver's calls to its actors, none waited on longer than asked: at most one call per key (an actor and
    its method) is outstanding; a poll that finds it unanswered returns at once and asks again only once the
    actor answered, so a stopped actor neither blocks the driver nor collects a queue of calls, and nothing it
    returns late (popped metrics) is lost.  `silent()` says who has not answered, and for how long."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[Any, float]] = {}

    def poll(self, key: str, start: Callable[[], Any], wait_s: float = 0.0) -> tuple[bool, Any]:
        """(True, result) when the call `key` answered within `wait_s` (`start()` issues it when none is
        outstanding), else (False, None).  An actor's error is raised."""
        import ray

        if key not in self.pending:
            self.pending[key] = (start(), time.monotonic())
        ref, _ = self.pending[key]
        if not ray.wait([ref], timeout=wait_s)[0]:
            return False, None
        del self.pending[key]
        return True, ray.get(ref)

    def get(self, key: str, start: Callable[[], Any], deadline_s: float) -> Any:
        """The answer of `key`, waited on at most `deadline_s`; Unresponsive naming it otherwise."""
        done, result = self.poll(key, start, deadline_s)
        if not done:
            raise Unresponsive(f"{key} did not answer within {deadline_s:g}s: {UNRESPONSIVE}")
        return result

    def silent(self) -> dict[str, float]:
        """Seconds each outstanding call has waited so far."""
        now = time.monotonic()
        return {key: now - t0 for key, (_, t0) in self.pending.items()}


def ray_get(refs: Any, timeout: Optional[float] = None) -> Any:
    """`ray.get`, imported lazily (modules that call actors stay importable without Ray)."""
    import ray

    return ray.get(refs, timeout=timeout)


@contextlib.contextmanager
def ray_processes_in_own_session() -> Any:
    """While Ray starts a local cluster, every process it spawns (GCS, raylet, agents; the raylet's workers inherit
    its session) starts in a session of its own, so the signals a scheduler, `timeout` or `kill -- -PGID` send to
    the job's process group, and a closed terminal's SIGHUP, reach only the driver, which then stops the run
    gracefully and shuts Ray down itself.  Their lifetime stays bound to the driver: Ray starts them with
    kernel fate-sharing (they die with the driver's process) and `ray.shutdown()` ends them.  Ray 2.x spawns them
    all through `ray._private.services.ConsolePopen`; without it (another Ray) they start as before."""
    try:
        from ray._private import services
        original = services.ConsolePopen
    except (ImportError, AttributeError):  # pragma: no cover - a Ray that spawns differently
        logger.warning("Ray's processes start in the driver's process group: a signal to the whole group reaches "
                       "them too")
        yield
        return

    class OwnSession(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = original


def private_temp_root() -> str:
    """`<tmp>/fully_async-<uid>/ray`: the root of the local Ray's session folders, inside a folder only this user
    may enter (Ray makes its session folders, sockets and logs world-writable; inside a 0700 folder nobody else
    reaches them)."""
    import tempfile

    parent = os.path.join(tempfile.gettempdir(), f"fully_async-{os.getuid()}")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    st = os.lstat(parent)
    if st.st_uid != os.getuid() or not os.path.isdir(parent) or os.path.islink(parent):
        raise RunFailed(f"{parent} (the private root of this run's Ray sessions) is not a folder owned by this user; "
                        "remove it or set TMPDIR to another folder")
    os.chmod(parent, 0o700)
    return os.path.join(parent, "ray")


AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
LISTENS_EVERYWHERE = ("Ray (2.60) binds the local cluster's GCS, raylet and worker servers to every network interface "
                      "whatever address it advertises")


def private_auth_token() -> Optional[str]:
    """Token authentication for the local Ray this run starts, with a token of its own: Ray's servers listen on
    every interface (LISTENS_EVERYWHERE; no Ray option binds them to the loopback), so what keeps other machines
    and users out is the token every request must carry.  A fresh random token per run, in a 0600 file inside
    the user's 0700 root (`private_temp_root`), where Ray's own default is one long-lived `~/.ray/auth_token`
    written with the umask's permissions; Ray's processes inherit `RAY_AUTH_TOKEN_PATH`.  A token the user gave
    (`RAY_AUTH_TOKEN` / `RAY_AUTH_TOKEN_PATH`) is used instead; `RAY_AUTH_MODE=disabled` is the user's to set and
    is warned about.  Returns the token file written, if any (removed when the driver exits)."""
    import atexit
    import secrets

    mode = os.environ.get(AUTH_MODE, "").lower()
    if mode == "disabled":
        logger.warning("%s=disabled: %s, so anyone who can reach this machine's ports can run code as this user in "
                       "this run's Ray; unset it to keep Ray's token authentication on", AUTH_MODE, LISTENS_EVERYWHERE)
        return None
    path = None
    if not (os.environ.get(AUTH_TOKEN) or os.environ.get(AUTH_TOKEN_PATH)):
        name = f"ray_auth_token.{os.getpid()}.{secrets.token_hex(4)}"
        path = os.path.join(os.path.dirname(private_temp_root()), name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        atexit.register(lambda: os.path.exists(path) and os.remove(path))
        os.environ[AUTH_TOKEN_PATH] = path
    os.environ[AUTH_MODE] = "token"
    try:  # Ray caches the mode and the token per process; a driver that started a Ray before reads them again
        from ray._raylet import AuthenticationTokenLoader, Config
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - a Ray without token authentication
        logger.warning("this Ray has no token authentication: %s, unauthenticated", LISTENS_EVERYWHERE)
    return path


def session_dir() -> Optional[str]:
    try:
        import ray

        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - a Ray that does not say
        return None


# Ray's accelerator families besides GPU that a local start could count instead of the run's device
OTHER_ACCELERATORS = ("NPU",)


def accelerator_counts(accelerator: str) -> dict:
    """ray.init arguments that make a local Ray count the run's accelerator kind (GPU | NPU | "" for CPU): Ray
    keeps one accelerator family per node and picks the first it finds in a set's order, which changes from process
    to process, so on a node with two (a GPU box running the NPU path) it would count either.  The other families
    are set to 0; the run's own is left to Ray's detection."""
    if not accelerator:
        return {}
    out: dict = {} if accelerator == "GPU" else {"num_gpus": 0}
    others = {name: 0 for name in OTHER_ACCELERATORS if name != accelerator}
    return {**out, "resources": others} if others else out


def plain_log_prefixes(streams: Optional[tuple] = None) -> bool:
    """No ANSI colour codes into a pipe or a file: Ray colours the `(Actor pid=...)` prefix of every actor line it
    forwards to the driver unless RAY_COLOR_PREFIX=0, which it reads as it prints; set here (the user's own setting
    kept) when the driver's stdout or stderr is not a terminal.  Returns whether the prefixes are plain."""
    import sys

    def tty(stream: Any) -> bool:
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError):
            return False

    if "RAY_COLOR_PREFIX" not in os.environ and not all(tty(s) for s in (streams or (sys.stdout, sys.stderr))):
        os.environ["RAY_COLOR_PREFIX"] = "0"
    return os.environ.get("RAY_COLOR_PREFIX") == "0"


@contextlib.contextmanager
def inherited_by_ray(env_vars: dict[str, str]) -> Any:
    """`env_vars` in this process's environment while ray.init starts a local Ray (restored after): its raylet
    inherits them, and every worker the raylet starts inherits the raylet's environment, so each actor sees them as a
    job-level runtime_env would show them.  A runtime_env would cost each worker a second Python start and Ray
    import (Ray's runtime-env wrapper, setup_worker.py, then the worker), and leave unused the idle workers Ray
    starts for the first driver (they have no runtime_env): ~0.5 s of CPU per actor on a 2-core machine."""
    saved = {key: os.environ.get(key) for key in env_vars}
    os.environ.update(env_vars)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_ray(num_cpus_needed: int, env_vars: Optional[dict] = None, address: Optional[str] = None,
              namespace: Optional[str] = None, accelerator: str = "") -> bool:
    """Join `address` (else `RAY_ADDRESS`) when set, else start a local Ray; returns True when we started it.
    `env_vars` reach every actor (the device's runtime variables, device.py: a joined cluster's through the job's
    runtime_env, a local Ray's through its processes' environment, `inherited_by_ray`); `namespace`: the job's own Ray
    namespace (jobs sharing a cluster keep their actor names apart).  A local Ray is this run's own: it
    advertises the loopback address, answers only requests carrying this run's token (`private_auth_token`: Ray
    listens on every interface), its processes are shielded from the job's process-group signals
    (`ray_processes_in_own_session`) and its session folders are private to the user (`private_temp_root`); it
    counts the run's `accelerator` kind (`accelerator_counts`)."""
    import ray

    if ray.is_initialized():
        return False
    plain_log_prefixes()
    address = address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env_vars or {})}}
    if address:
        try:
            ray.init(address=address, runtime_env=env, log_to_driver=True, namespace=namespace)
        except ConnectionError as exc:
            raise RunFailed(f"cannot join the Ray cluster at {address}: {exc}") from None
        return False
    from fully_async.cluster.leftovers import clean_dead_drivers

    clean_dead_drivers()   # what a SIGKILLed run left (Ray agents, its token file), each said
    private_auth_token()
    with ray_processes_in_own_session(), inherited_by_ray(env["env_vars"]):
        ray.init(num_cpus=max(num_cpus_needed, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True,
                 _node_ip_address="127.0.0.1", _temp_dir=private_temp_root(), **accelerator_counts(accelerator))
    logger.info("local Ray started, its processes in a session of their own; session folder %s (in a 0700 folder)",
                session_dir())
    return True


CPU_PROCESSES_PER_CORE = 2  # CPU "devices" (each a process with its own model copy) a core runs usefully


def check_cpu_devices(needs: dict[str, int], cores: Optional[int] = None) -> None:
    """trainer.device=cpu on a Ray this run starts: every trainer rank and rollout replica is a process with its
    own model copy; more than CPU_PROCESSES_PER_CORE per core only thrash (64 ranks on 2 cores never finish a
    step).  Checked before Ray starts."""
    cores = cores or os.cpu_count() or 1
    want, limit = sum(needs.values()), CPU_PROCESSES_PER_CORE * cores
    if want > limit:
        detail = ", ".join(f"{k}={v}" for k, v in needs.items())
        raise RunFailed(f"trainer.device=cpu: the config asks for {want} CPU devices ({detail}), each a process with "
                        f"its own copy of the model, but this machine has {cores} cores (at most {limit} such "
                        "processes); lower trainer.n_gpus_per_node / actor_rollout_ref.rollout.n_gpus_per_node, or "
                        "join a larger Ray cluster (multi_job.ray_address / RAY_ADDRESS)")


def check_resources(device: Any, needs: dict[str, int]) -> None:
    """Fail before creating actors when Ray lacks the devices the config asks for: accelerators of its kind, and on
    CPU one core per trainer rank and rollout replica (each actor asks Ray for one; short of them, they would wait
    for ever)."""
    import ray

    if not device.is_accelerator:
        have, want = int(ray.cluster_resources().get("CPU", 0)), sum(needs.values())
        if want > have:
            detail = ", ".join(f"{k}={v}" for k, v in needs.items())
            raise RunFailed(f"trainer.device=cpu: the config asks for {want} CPU devices ({detail}), one core each, "
                            f"but the Ray cluster has {have} CPU; lower trainer.n_gpus_per_node / "
                            "actor_rollout_ref.rollout.n_gpus_per_node or add nodes")
        return
    have = int(ray.cluster_resources().get(device.ray_resource, 0))
    want = sum(needs.values())
    if want > have:
        detail = ", ".join(f"{k}={v}" for k, v in needs.items())
        raise RunFailed(f"the config asks for {want} {device.name} devices ({detail}) but the Ray cluster has "
                        f"{have} {device.ray_resource}; lower trainer.n_gpus_per_node / rollout.n_gpus_per_node "
                        "or add nodes")


def root_cause(exc: BaseException) -> BaseException:
    """The user's exception inside a RayTaskError (or the Ray error itself)."""
    for _ in range(8):  # ActorDiedError -> RayTaskError -> the constructor's exception
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    return exc


_RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*): (.+)$")   # "pkg.module.ExcType: message"


def describe(exc: BaseException) -> str:
    """'<Type>: <message>' of the user's exception behind a Ray error.  An actor whose constructor raised and that
    was called after it died gives an ActorDiedError holding only the text of that RayTaskError (its traceback
    included): the raised exception's last line is taken from it, so nobody reads a traceback from inside Ray."""
    cause = root_cause(exc)
    if getattr(cause, "actor_init_failed", False):
        lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
        for line in reversed(lines):
            m = _RAISED.match(line)
            if m and not line.startswith(("File ", "ray::")):
                return f"{m.group(1)}: {m.group(2)}"
    return f"{type(cause).__name__}: {cause}"


def is_secondary(exc: BaseException) -> bool:
    """Errors that only say 'the other actor died' (the root cause is elsewhere)."""
    import ray.exceptions as rex

    return isinstance(root_cause(exc), (rex.RayActorError, rex.ActorDiedError))


def supervise(runs: dict[Any, str], until: str, on_tick: Callable[[], None], tick_s: float = 0.5,
              deadline_s: Optional[float] = None, helpers: Optional[dict[str, Any]] = None) -> Any:
    """Wait for the run named `until` to finish while ticking (returns its result); raise RunFailed
    on any failure, including one raised by `on_tick` (the watchdog), and Unresponsive when `deadline_s` passes.

    When several actors fail together, report the one whose error is not just "actor died"; when every error is
    only that, an actor without a run() (`helpers`: the queue) that died is the cause and is named.
    """
    import ray

    pending = dict(runs)
    t0 = time.monotonic()
    while True:
        if deadline_s is not None and time.monotonic() - t0 > deadline_s:
            raise Unresponsive(f"{until} did not finish within {deadline_s:g}s of being asked to stop: {UNRESPONSIVE}")
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=tick_s)
        for ref in ready:
            name = pending.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - anything from an actor ends the run
                raise _failure(name, exc, pending, helpers) from None
            if name == until:
                return result
            logger.warning("%s finished before %s", name, until)
        try:
            on_tick()
        except RunFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - polling hit a dead actor: its run() has the root cause
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=10)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as run_exc:  # noqa: BLE001
                    name = pending.pop(ref)
                    raise _failure(name, run_exc, pending, helpers) from None
            raise RunFailed(dead_helper(helpers) or f"lost contact with an actor: {type(exc).__name__}: {exc}") from None


def dead_helper(helpers: Optional[dict[str, Any]]) -> Optional[str]:
    """'<name> died: <cause>' for the first of `helpers` (actors without a run()) that no longer answers."""
    import ray

    for name, handle in (helpers or {}).items():
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.GetTimeoutError:
            continue  # alive but busy: not the cause
        except Exception as exc:  # noqa: BLE001 - dead: its death is the story
            return f"{name} died: {describe(exc).splitlines()[0]}"
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_traceback(exc: BaseException) -> str:
    """The failing code's traceback behind a Ray error: the remote one a RayTaskError's text holds (the actor's
    frames, `File ...` lines, down to the raised exception), else the exception's own."""
    import traceback

    import ray.exceptions as rex

    seen: BaseException = exc
    for _ in range(8):   # ActorDiedError -> RayTaskError -> the user's exception
        if isinstance(seen, rex.RayTaskError):
            return _ANSI.sub("", str(seen)).strip() + "\n"
        cause = getattr(seen, "cause", None)
        if not isinstance(cause, BaseException) or cause is seen:
            break
        seen = cause
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _failure(name: str, exc: BaseException, others: dict[Any, str],
             helpers: Optional[dict[str, Any]] = None) -> RunFailed:
    """The RunFailed of an actor's failure: the message names the actor and the root cause, and carries its
    traceback."""
    message, cause = _failure_message(name, exc, others, helpers)
    return RunFailed(message, details=failure_traceback(cause))


def _failure_message(name: str, exc: BaseException, others: dict[Any, str],
                     helpers: Optional[dict[str, Any]] = None) -> tuple[str, BaseException]:
    import ray

    failures = [(name, exc)]
    if is_secondary(exc):  # give the other side a moment to report its own error
        ready, _ = ray.wait(list(others), num_returns=len(others), timeout=5.0)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as other:  # noqa: BLE001
                failures.append((others[ref], other))
    name, exc = next(((n, e) for n, e in failures if not is_secondary(e)), failures[0])
    if is_secondary(exc):
        helper = dead_helper(helpers)
        if helper is not None:
            return f"{helper} (then {name} failed calling it)", exc
    return f"{name} failed: {describe(exc)}", exc


def kill_all(handles: list[Any]) -> None:
    import ray

    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass


def wait_ready(handles: dict[str, Any], timeout_s: Optional[float] = None,
               on_tick: Optional[Callable[[], None]] = None) -> float:
    """Block until every actor's constructor finished (errors surface here, named); `on_tick` is called about
    twice a second meanwhile (the launcher stops here when a signal came)."""
    import ray

    start = time.perf_counter()
    refs = {name: handle.ready.remote() for name, handle in handles.items()}
    for name, ref in refs.items():
        while not ray.wait([ref], timeout=0.5)[0]:
            if on_tick is not None:
                on_tick()
            if timeout_s is not None and time.perf_counter() - start > timeout_s:
                break
        try:
            ray.get(ref, timeout=0 if timeout_s is not None else None)
        except Exception as exc:  # noqa: BLE001
            raise RunFailed(f"{name} failed to start: {describe(exc)}") from None
    return time.perf_counter() - start
