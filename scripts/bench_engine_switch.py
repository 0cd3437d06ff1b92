"""What a turn switch costs the embedded engine, and what it frees: the engine's memory at fixed addresses (CUDA VMM,
device_memory/) against the old sleep (drop the cache and the graphs, move the weights), in one invocation.

    python scripts/bench_engine_switch.py --model /tmp/m05 --device cuda --slots 256 --max-len 3088 \
        --out /tmp/switch.json

For each way ("vmm": the default on CUDA; "none": the old sleep) one engine decodes `--slots` greedy responses
of up to `--tokens` tokens; after `--before` steps it sleeps (twice: the second switch is the steady one) with the responses kept in flight (their KV swapped to
pinned host memory, as pause_mode=keep does in the trainer's turn), wakes, and decodes to the end.  Printed and
written: the device memory in use before the sleep, while asleep and after the wake (mem_get_info: every process's),
the sleep's and the wake's seconds (swap-out and swap-in included), the graph captures the wake caused and the first
`--after` steps' time after the wake against the same number of steady steps before the sleep (the re-capture cost),
and whether every response equals that of an engine that never slept.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def one(args: argparse.Namespace, memory: str, reference: dict | None) -> dict:
    from fully_async.core.types import GenRequest, SamplingParams
    from fully_async.device import get_device
    from fully_async.rollout.engines.hf_engine import HFEngine

    device = get_device(args.device)
    eng = HFEngine(args.model, device, dtype=args.dtype, max_num_seqs=args.slots, eos_token_ids=[], pad_token_id=0,
                   max_model_len=args.max_len, enforce_eager=args.device == "cpu", device_memory=memory,
                   keep_in_flight=True)
    prompts = [[(7 * i + j) % 19 + 2 for j in range(args.prompt)] for i in range(args.slots)]
    reqs = [GenRequest(f"r{i}", p, SamplingParams(0.0, max_tokens=args.tokens)) for i, p in enumerate(prompts)]
    used = lambda: (device.mem_info()[1] - device.mem_info()[0]) / 2**30   # noqa: E731
    out: dict = {"memory": memory if eng.memory is None else eng.memory.backend.name, "startup_s": eng.startup_s}
    done: dict = {}

    def steps(n: int) -> float:
        device.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            done.update({o.request_id: o for o in eng.collect()})
        device.synchronize()
        return time.perf_counter() - start

    eng.submit(reqs)
    for cycle in (1, 2):   # the first switch pays the host buffers' first allocation; the second is the steady one
        steps(args.before - args.after)
        c: dict = {"steady_steps_s": steps(args.after)}
        captures = eng.memory_stats["graph_captures"]
        c["used_gib_before"] = used()
        start = time.perf_counter()
        eng.sleep(1, keep_in_flight=True)
        c["sleep_s"] = time.perf_counter() - start
        c["used_gib_asleep"] = used()
        start = time.perf_counter()
        eng.wake_up()
        c["wake_s"] = time.perf_counter() - start
        c["used_gib_awake"] = used()
        c["steps_after_wake_s"] = steps(args.after)
        c["graph_captures_after_wake"] = eng.memory_stats["graph_captures"] - captures
        c.update({k: v for k, v in eng.memory_report().items() if "switch" in k or "swap" in k})
        c["freed_gib"] = c["used_gib_before"] - c["used_gib_asleep"]
        c["switch_s"] = c["sleep_s"] + c["wake_s"] + max(0.0, c["steps_after_wake_s"] - c["steady_steps_s"])
        out[f"switch_{cycle}"] = c
    while eng.num_in_flight():
        done.update({o.request_id: o for o in eng.collect()})
    tokens = {k: o.token_ids for k, o in done.items()}
    out["responses"] = len(tokens)
    if reference is not None:
        out["identical_to_never_slept"] = tokens == reference
    eng.sleep(1)   # its memory back to the device before the next way's engine is built
    return out, tokens


def never_slept(args: argparse.Namespace) -> dict:
    from fully_async.core.types import GenRequest, SamplingParams
    from fully_async.device import get_device
    from fully_async.rollout.engines.base import run_requests
    from fully_async.rollout.engines.hf_engine import HFEngine

    eng = HFEngine(args.model, get_device(args.device), dtype=args.dtype, max_num_seqs=args.slots, eos_token_ids=[],
                   pad_token_id=0, max_model_len=args.max_len, enforce_eager=args.device == "cpu",
                   free_cache_engine=False)
    prompts = [[(7 * i + j) % 19 + 2 for j in range(args.prompt)] for i in range(args.slots)]
    reqs = [GenRequest(f"r{i}", p, SamplingParams(0.0, max_tokens=args.tokens)) for i, p in enumerate(prompts)]
    out = {k: o.token_ids for k, o in run_requests(eng, reqs, timeout_s=3600.0).items()}
    del eng
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=3088)
    p.add_argument("--before", type=int, default=600, help="decode steps before the sleep")
    p.add_argument("--after", type=int, default=50, help="steps timed after the wake (and before the sleep)")
    p.add_argument("--ways", default="none,auto", help="device memory backends to measure, in order")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    reference = never_slept(args)
    result = {"args": vars(args), "ways": {}}
    for way in args.ways.split(","):
        result["ways"][way], _ = one(args, way, reference)
        print(way, json.dumps(result["ways"][way], indent=None), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if all(w.get("identical_to_never_slept", True) for w in result["ways"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
