"""Weight-sync time and bandwidth: collective broadcast vs Ray object store, side by side.

    python scripts/bench_weight_sync.py --shapes 0.5b 3b --device cuda --out weight_sync.json
    python scripts/bench_weight_sync.py --shapes tiny --device cpu          # smoke test (gloo)
    python scripts/bench_weight_sync.py --shapes 0.5b 3b --replicas 1 3 7   # one broadcast to K engines (K+1 devices)
    python scripts/bench_weight_sync.py --engine vllm --device cpu --models fully_async/assets/tiny_arithmetic/model

Two Ray actors on two devices: a sender holding a Qwen2-shaped parameter set (random values,
bf16 on accelerators) and a receiver holding a Qwen2 model of the same shape, as a rollout
engine would.  `--replicas K`: K receivers, each on its own device, join one broadcast group
(rank 0 the sender, ranks 1..K the receivers, as a rollout pool of K engine replicas does), and a
time is the push until the slowest receiver has loaded; collective only.  Each weight update goes through the package's real transports
(fully_async.weight_sync.{collective,object_store}) into `load_named_tensors`, the engine's load.

`--engine vllm`: the receiver is a real VLLMEngine on each checkpoint of `--models` (the sender
holds the same weights), and three paths are timed: `collective_direct` (every vLLM worker
joins the broadcast group and loads the buckets itself), `collective_host` (the receiving actor
takes the broadcast into its own memory, then the engine re-serialises it to its workers: the
path before workers received directly) and `object_store`.  A time is one whole update: from
the push until the engine holds the new weights.  Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

SHAPES = {  # Qwen2 configs: vocab, hidden, layers, heads, kv heads, intermediate
    "tiny": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=128),
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    "3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
}


def build_model(shape: str, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)
    with torch.device(device.torch_device()):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model.eval().requires_grad_(False)


def load_model(path: str, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device.torch_device()):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval().requires_grad_(False)


def weights_checksum(model: Any) -> float:
    """One number of a model's weights (float64 sum of |w| by parameter index), to tell that a receiver holds the
    sender's weights after an update."""
    return float(sum((i + 1) * p.detach().double().abs().sum().item() for i, p in enumerate(model.parameters())))


def object_store_weights(named: Any) -> Any:
    """The weights of an object-store push: it hands [ObjectRef] (unresolved, as to the rollouter, whose replicas
    read the one copy); a receiver here reads it itself."""
    import ray

    return ray.get(named[0]) if isinstance(named, list) and len(named) == 1 else named


class Sender:
    """Looks like a trainer backend to the weight-sync classes."""

    def __init__(self, shape: str, device_name: str, model_path: str = ""):
        from fully_async.device import get_device, parse_dtype

        self.device = get_device(device_name)
        self.device.set_device(0)
        self.dtype = parse_dtype("bfloat16" if self.device.is_accelerator else "float32")
        self.model = (load_model(model_path, self.device, self.dtype) if model_path
                      else build_model(shape, self.device, self.dtype))
        self.rank = 0

    def param_shapes(self) -> list:
        return [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def stream_full_parameters(self, consumer: Any) -> Any:
        return consumer((n, p.detach()) for n, p in self.model.named_parameters())

    def named_parameters_for_sync(self) -> dict:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def checksum(self) -> float:
        return weights_checksum(self.model)

    def run(self, receiver: Any, transport: str, repeats: int, bucket_mb: int) -> list[dict]:
        from fully_async.weight_sync.collective import CollectiveWeightSync
        from fully_async.weight_sync.object_store import ObjectStoreWeightSync

        if transport == "collective":
            sync = CollectiveWeightSync(self, receiver, self.device, bucket_mb, self.dtype)
        else:
            sync = ObjectStoreWeightSync(self, receiver)
        out = []
        for version in range(repeats + 1):  # the first push also sets the group up: not timed
            self.device.synchronize()
            start = time.perf_counter()
            metrics = sync.push(version)
            metrics.update(sync.flush())  # the object-store push returns before the engine has loaded
            metrics["wall_s"] = time.perf_counter() - start
            if version:
                out.append(metrics)
        return out


class Receiver:
    """Looks like the rollouter to the weight-sync classes; loads into a real model."""

    def __init__(self, shape: str, device_name: str):
        from fully_async.device import get_device, parse_dtype

        self.device = get_device(device_name)
        self.device.set_device(0)
        self.model = build_model(shape, self.device, parse_dtype("bfloat16" if self.device.is_accelerator
                                                                 else "float32"))
        self.weight_pg = None

    def weight_receivers(self) -> int:
        return 1

    def checksum(self) -> float:
        return weights_checksum(self.model)

    def init_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        self.weight_pg = self.device.new_group(addr, port, rank, world)

    def _load(self, named: Any) -> dict:
        from fully_async.rollout.engines.hf_engine import load_named_tensors

        start = time.perf_counter()
        load_named_tensors(self.model, named)
        self.device.synchronize()
        return {"load": time.perf_counter() - start}

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> dict:
        import torch

        from fully_async.weight_sync.collective import receive
        return self._load(receive(self.weight_pg, metas, buckets, getattr(torch, dtype.split(".")[-1]),
                                  self.device.torch_device()))

    def update_weights(self, named: Any, version: int) -> dict:
        return self._load(object_store_weights(named))


class Receivers:
    """K Receiver actors behind one handle, as the rollouter's engine pool of K replicas is: ranks first_rank ..
    first_rank + K - 1 of the broadcast group, every one loading each bucket into its own model."""

    def __init__(self, receivers: list):
        self.receivers = receivers

    def weight_receivers(self) -> int:
        return len(self.receivers)

    def init_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        import ray

        ray.get([r.init_weight_group.remote(addr, port, rank + i, world) for i, r in enumerate(self.receivers)])

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> dict:
        import ray

        loads = ray.get([r.receive_weights.remote(metas, buckets, dtype, version) for r in self.receivers])
        return {"load": max(t["load"] for t in loads)}


class VLLMReceiver:
    """Looks like the rollouter with a vLLM engine.  `direct`: the engine's workers receive the broadcast
    themselves (engines.base.DirectWeightReceiver); otherwise this actor receives it into host tensors and
    hands the stream to `update_weights`, which ships it to the workers as safetensors blobs."""

    def __init__(self, model_path: str, device_name: str, bucket_mb: int):
        from fully_async.device import get_device
        from fully_async.rollout.engines.vllm_engine import VLLMEngine

        self.device = get_device(device_name)
        with open(os.path.join(model_path, "config.json")) as fh:
            max_len = min(256, json.load(fh).get("max_position_embeddings", 256))
        self.engine = VLLMEngine(model_path, self.device, max_num_seqs=8, max_model_len=max_len, load_format="dummy",
                                 update_weights_bucket_megabytes=bucket_mb)
        self.direct = True
        self.weight_pg = None

    def set_direct(self, direct: bool) -> None:
        self.direct = direct

    def weight_receivers(self) -> int:
        return self.engine.weight_receivers() if self.direct else 1

    def init_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        if self.direct:
            self.engine.init_weight_group(addr, port, rank, world)
        else:
            self.weight_pg = self.device.new_group(addr, port, rank, world)

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> dict:
        import torch

        from fully_async.weight_sync.collective import receive

        if self.direct:
            return self._load(lambda: self.engine.receive_weights(metas, buckets, dtype, version))
        stream = receive(self.weight_pg, metas, buckets, getattr(torch, dtype.split(".")[-1]),
                         self.device.torch_device())
        return self._load(lambda: self.engine.update_weights(stream, version))

    def update_weights(self, named: Any, version: int) -> dict:
        named = object_store_weights(named)
        return self._load(lambda: self.engine.update_weights(named, version))

    def _load(self, load: Any) -> dict:
        start = time.perf_counter()
        load()
        return {"load": time.perf_counter() - start, **self.engine.last_update_timings}

    def close(self) -> None:
        self.engine.close()


def _row(label: str, transport: str, nbytes: int, runs: list[dict], repeats: int, device: Any,
         replicas: int = 1) -> dict:
    wall = statistics.median(r["wall_s"] for r in runs)
    return {"shape": label, "transport": transport, "replicas": replicas, "gbytes": nbytes / 1e9, "median_s": wall,
            "gbps": nbytes / 1e9 / wall, "load_s": statistics.median(
                r.get("timing_s/param_sync/load", 0.0) for r in runs), "repeats": repeats, "device": device.name}


def measure_vllm(models: list[str], device_name: str, repeats: int, bucket_mb: int) -> list[dict]:
    import ray

    from fully_async.device import get_device

    device = get_device(device_name)
    opts = device.ray_actor_options(1)
    rows = []
    for path in models:
        parent, label = os.path.split(os.path.normpath(path))
        label = os.path.basename(parent) if label == "model" else label  # assets/<name>/model -> <name>
        sender = ray.remote(Sender).options(**opts).remote(label, device_name, path)
        receiver = ray.remote(VLLMReceiver).options(**opts).remote(path, device_name, bucket_mb)
        nbytes = ray.get(sender.nbytes.remote())
        for transport, direct in (("collective_direct", True), ("collective_host", False), ("object_store", False)):
            ray.get(receiver.set_direct.remote(direct))
            kind = "object_store" if transport == "object_store" else "collective"
            runs = ray.get(sender.run.remote(receiver, kind, repeats, bucket_mb))
            rows.append(_row(label, transport, nbytes, runs, repeats, device))
        ray.get(receiver.close.remote())
        ray.kill(sender)
        ray.kill(receiver)
    return rows


def measure(shapes: list[str], device_name: str, repeats: int, bucket_mb: int,
            replicas: list[int] | None = None, timeout_s: float = 600.0) -> list[dict]:
    """Per shape: collective and object store to one receiver (replicas None), or one broadcast to each K of
    `replicas` receivers on devices of their own (collective only; a fresh sender and receivers per K, so no
    group outlives its peers).  Each row is printed as it is measured; a transport that has not finished within
    `timeout_s` raises, naming the shape, K and what it was doing."""
    import ray

    from fully_async.device import get_device

    device = get_device(device_name)
    opts = device.ray_actor_options(1)
    rows = []

    def wait(refs: Any, what: str) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{what}: not done within {timeout_s:g}s") from None

    for shape in shapes:
        for k in replicas or [1]:
            sender = ray.remote(Sender).options(**opts).remote(shape, device_name)
            actors = [ray.remote(Receiver).options(**opts).remote(shape, device_name) for _ in range(k)]
            receiver = actors[0] if replicas is None else ray.remote(Receivers).options(num_cpus=0).remote(actors)
            nbytes = wait(sender.nbytes.remote(), f"{shape}: building the sender and {k} receiver(s)")
            wait([a.checksum.remote() for a in actors], f"{shape}: building {k} receiver(s)")
            for transport in ("collective", "object_store") if replicas is None else ("collective",):
                what = f"{shape} {transport} to {k} receiver(s)"
                print(f"[bench] {what} ...", flush=True)
                runs = wait(sender.run.remote(receiver, transport, repeats, bucket_mb), what)
                rows.append(_row(shape, transport, nbytes, runs, repeats, device, k))
                print(f"[bench] {what}: median {rows[-1]['median_s']:.4f} s", flush=True)
                want, got = wait(sender.checksum.remote(), what), wait([a.checksum.remote() for a in actors], what)
                if any(g != want for g in got):
                    raise RuntimeError(f"{what}: a receiver's weights differ from the sender's (checksums {got} "
                                       f"vs {want})")
            for actor in {id(a): a for a in [receiver, *actors, sender]}.values():
                ray.kill(actor)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["0.5b"], choices=sorted(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="receiver: a transformers model (hf) or a real VLLMEngine on --models")
    p.add_argument("--models", nargs="+", default=[],
                   help="--engine vllm: checkpoint directories (e.g. scripts/build_shaped_model.py output)")
    p.add_argument("--replicas", nargs="+", type=int, metavar="K",
                   help="one collective broadcast to K receivers on K devices of their own (K+1 devices in all), "
                        "for each K given; the 1-receiver time is the baseline")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a transport's updates may take (default 600)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.engine == "vllm" and not args.models:
        p.error("--engine vllm needs --models DIR [DIR ...]")
    if args.replicas and (args.engine != "hf" or min(args.replicas) < 1):
        p.error("--replicas takes K >= 1 with the hf receiver")
    import ray

    from fully_async.device import describe_hardware, get_device

    ray.init(include_dashboard=False, log_to_driver=False,
             num_cpus=max(1 + max(args.replicas or [1]), os.cpu_count() or 2))  # a CPU device is one CPU per actor
    try:
        if args.engine == "vllm":
            rows = measure_vllm(args.models, args.device, args.repeats, args.bucket_mb)
        else:
            rows = measure(args.shapes, args.device, args.repeats, args.bucket_mb, args.replicas, args.timeout)
    finally:
        ray.shutdown()
    print(f"hardware: {describe_hardware(get_device(args.device))}")
    width = max(6, *(len(r["shape"]) for r in rows))
    print(f"{'shape':<{width}} {'transport':<17} {'replicas':>8} {'GB':>7} {'median s':>9} {'GB/s':>7} "
          f"{'load s':>7} {'x 1 replica':>11}")
    one = {(r["shape"], r["transport"]): r["median_s"] for r in rows if r["replicas"] == 1}
    for r in rows:
        ratio = r["median_s"] / one[(r["shape"], r["transport"])] if (r["shape"], r["transport"]) in one else None
        r["x_one_replica"] = ratio
        print(f"{r['shape']:<{width}} {r['transport']:<17} {r['replicas']:8d} {r['gbytes']:7.3f} {r['median_s']:9.3f} "
              f"{r['gbps']:7.2f} {r['load_s']:7.3f} {'' if ratio is None else f'{ratio:.2f}x':>11}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
