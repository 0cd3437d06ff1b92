"""Small builders shared by tests."""
import contextlib
import os

import torch

from fully_async.core.types import Sample


def free_ports(n: int) -> list[int]:
    """`n` distinct free local ports: every socket stays bound until all are chosen (a port closed before the next
    is picked may be handed out again; the suite's two workers also start Ray heads side by side)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tiny_samples(seed: int = 0, groups: int = 2, n: int = 2, vocab: int = 21):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(groups):
        prompt = torch.randint(2, vocab, (4,), generator=g).tolist()
        for j in range(n):
            resp = torch.randint(2, vocab, (3,), generator=g).tolist()
            out.append(Sample(uid=f"g{gi}", sample_id=f"g{gi}-{j}", prompt_ids=prompt, response_ids=resp,
                              rollout_log_probs=[-1.0] * 3, versions=[0] * 3, reward=float(j)))
    return out


def read_scalars(logdir):
    """{tag: [(step, value), ...]} of a TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(logdir):
    """{tag: [(step, text), ...]} of the text summaries (SummaryWriter.add_text) of a TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        out[tag.removesuffix("/text_summary")] = [(e.step, e.tensor_proto.string_val[0].decode())
                                                  for e in acc.Tensors(tag)]
    return out


def check_val_generations(dump_dir, tb_dir, steps, rows_each):
    """trainer.validation_data_dir holds <step>.jsonl for every validation step, `rows_each` rows of verl's keys
    each, and TensorBoard's val/generations text has 2 samples (trainer.log_val_generations=2) at those steps."""
    import json

    assert sorted(int(p.split(".")[0]) for p in os.listdir(dump_dir)) == sorted(steps)
    for step in steps:
        with open(os.path.join(dump_dir, f"{step}.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
        assert len(rows) == rows_each
        assert all({"input", "output", "gts", "score", "step"} <= set(r) and r["step"] == step for r in rows)
        assert all(isinstance(r["score"], float) and r["input"] for r in rows)
    texts = dict(read_texts(tb_dir)["val/generations"])
    assert sorted(texts) == sorted(steps)
    assert all(t.count("### Sample ") == 2 and "**Score:**" in t for t in texts.values())


def check_rollout_dump(dump_dir, steps, rows_each):
    """trainer.rollout_data_dir holds <step>.jsonl for every trained step, `rows_each` rows each with the ground
    truth of the response's prompt."""
    import json

    assert sorted(int(p.split(".")[0]) for p in os.listdir(dump_dir)) == list(steps)
    for step in steps:
        with open(os.path.join(dump_dir, f"{step}.jsonl")) as fh:
            rows = [json.loads(line) for line in fh]
        assert len(rows) == rows_each and all(r["step"] == step and r["gts"] is not None for r in rows)
        assert all(isinstance(r["score"], float) and r["input"] for r in rows)


def first_and_last_val(logdir, tag="val-core/arithmetic/reward/mean@1"):
    """(first, last) validation reward of a TensorBoard run directory, by step."""
    vals = dict(read_scalars(logdir)[tag])
    return vals[min(vals)], vals[max(vals)]


@contextlib.contextmanager
def cpu_group(cfg, num_cpus: int = 3):
    """A trainer group of `cfg` on CPU ranks (this process is rank 0, the others Ray actors of a local Ray started
    for it), closed and Ray shut down after."""
    from fully_async.actors.train_worker import TrainWorker
    from fully_async.cluster.network import free_port
    from fully_async.device import CPU
    from fully_async.train.group import connect_trainer_group

    session = ray_session(num_cpus=num_cpus)
    next(session)
    try:
        group = connect_trainer_group(cfg, CPU, 10, ("127.0.0.1", free_port()), {"num_cpus": 1}, worker=TrainWorker)
        try:
            yield group
        finally:
            close_group(group)
    finally:
        next(session, None)


def close_group(group) -> None:
    """A trainer group built in the test's process (train/group.connect_trainer_group): the Ulysses groups and this
    process's rank of the process group gone, then its Ray ranks killed. In that order: gloo's I/O thread aborts the
    whole process (`terminate ... gloo::IoException`, SIGABRT) when a peer dies under an open connection, and this
    process is pytest."""
    import ray
    import torch.distributed as dist

    from fully_async.train.backends import ulysses

    ulysses.teardown()
    if dist.is_initialized():
        dist.destroy_process_group()
    for w in group.workers:
        ray.kill(w)


# the placements' "learns as sync does at equal steps" runs; conftest.sync_learning_run is the sync one
SYNC_LEARNING_STEPS = 10
SYNC_LEARNING = [f"trainer.total_training_steps={SYNC_LEARNING_STEPS}", "trainer.progress_bar=false",
                 "trainer.test_freq=5", "trainer.resume_mode=disable"]
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# every actor of the shared Ray sees these: the tests' own modules importable (fakes.py, reward functions), one thread
# per process, vLLM's CPU KV cache small
SHARED_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": TESTS_DIR,
              "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1"}   # vLLM-CPU's CI switch: no inductor compile
_shared_key: list = [None]   # the (num_cpus, env) of the Ray this process started through ray_session, if up


def ray_session(num_cpus: int, **env: str):
    """A local Ray for a test module (use with `yield from` in a module-scoped fixture).  A start costs ~5 s of the
    2-core CI machine, so the Ray is left up for the next module that asks for the same one (num_cpus and env
    variables); conftest.py shuts it down before a module that does not use this fixture, and at the end."""
    import ray

    key = (num_cpus, tuple(sorted({**SHARED_ENV, **env}.items())))
    if ray.is_initialized() and _shared_key[0] != key:
        shutdown_shared_ray()
    if not ray.is_initialized():
        from fully_async.cluster.ray_utils import inherited_by_ray

        # the variables reach the workers through the raylet's environment, not a runtime_env (a worker started
        # through the runtime-env wrapper costs a second Python start, and Ray's prestarted workers stay unused)
        with inherited_by_ray(dict(key[1])):
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        _shared_key[0] = key
    yield


def shutdown_shared_ray() -> None:
    import sys

    ray = sys.modules.get("ray")   # never imported: nothing to shut down (and no ~1 s import for it)
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    _shared_key[0] = None


def _leveldb_records(path, ident):
    """The records of a LevelDB-log-format file (W&B's run-<id>.wandb, SwanLab's run-<id>.swanlab): a 7-byte file
    header, then 32 KiB blocks of records, each with a 7-byte header (crc32, length, type: full/first/middle/last)."""
    import struct

    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:len(ident)] == ident, f"{path} does not start with {ident!r}"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero fill to the end of the block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            yield pending
            pending = b""


def read_wandb_offline(wandb_dir):
    """{key: [(step, value), ...]} of the one offline W&B run under `wandb_dir` (read from its run-<id>.wandb file),
    the step being the `training/global_step` each row was logged with."""
    import glob
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    files = glob.glob(os.path.join(wandb_dir, "**", "offline-run-*", "run-*.wandb"), recursive=True)
    assert len(files) == 1, files
    out = {}
    for raw in _leveldb_records(files[0], b":W&B"):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(row["training/global_step"])
        for key, value in row.items():
            if not key.startswith("_"):
                out.setdefault(key, []).append((step, value))
    return out


def read_swanlab(log_dir):
    """{key: [(step, value), ...]} of the one SwanLab run under `log_dir` (local/offline mode), from its
    run-<id>.swanlab record file."""
    import glob

    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    files = glob.glob(os.path.join(log_dir, "run-*", "run-*.swanlab"))
    assert len(files) == 1, files
    out = {}
    for raw in _leveldb_records(files[0], b":SWL"):
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            out.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
    return out


def read_mlflow_file_store(root):
    """{key: [(step, value), ...]} of the one MLflow run in the file store at `root`: its metrics folder holds one
    file per key (the key's `/` as folders), a line `timestamp value step` per logged value."""
    import glob

    runs = [d for d in glob.glob(os.path.join(root, "*", "*", "metrics")) if os.path.isdir(d)]
    assert len(runs) == 1, runs
    out = {}
    for dirpath, _, files in os.walk(runs[0]):
        for name in files:
            key = os.path.relpath(os.path.join(dirpath, name), runs[0]).replace(os.sep, "/")
            with open(os.path.join(dirpath, name)) as fh:
                rows = [line.split() for line in fh if line.strip()]
            out[key] = [(int(step), float(value)) for _, value, step in rows]
    return out
