"""Where does a graphed decode step of the embedded engine go? GPU kernel time per step vs wall per step."""
import sys, time, json, os, torch
from fully_async.device import get_device
from fully_async.rollout.engines.hf_engine import HFEngine
from fully_async.core.types import GenRequest, SamplingParams
dev = get_device("cuda"); dev.set_device(0)
model, n, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = HFEngine(model, dev, dtype="bfloat16", max_num_seqs=n, eos_token_ids=[], pad_token_id=0, max_model_len=3088,
               enforce_eager=False)
eng.submit([GenRequest(f"r{i}", [5 + i % 50] * 16, SamplingParams(1.0, 1.0, -1, 3072)) for i in range(n)])
for _ in range(warm):
    eng.collect()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(100):
    eng.collect()
torch.cuda.synchronize(); wall = (time.perf_counter() - t) / 100
# host time of one collect() without waiting: time python spends per step (approx by cProfile-free timer)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        eng.collect()
    torch.cuda.synchronize()
ka = prof.key_averages()
gpu = sum(e.self_device_time_total for e in ka) / 20 / 1e3
print(f"n={n} ctx~{16 + warm}: wall {wall * 1e3:.3f} ms/step, GPU kernels {gpu:.3f} ms/step")
rows = sorted([e for e in ka if e.self_device_time_total > 0], key=lambda e: -e.self_device_time_total)[:25]
for e in rows:
    print(f"  {e.self_device_time_total / 20 / 1e3:7.3f} ms  x{e.count / 20:6.1f}  {e.key[:90]}")
prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), f"trace_{n}_{warm}.json"))
