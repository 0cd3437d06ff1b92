"""The engine's device memory across a sleep (device_memory/, rollout/engines/engine_memory.py): arenas that give
their memory back and take it again at the same addresses, the keep-what-fits decision, KV swap of responses kept
in flight (identical continuations), and decode graphs that survive a sleep without a re-capture."""
import logging

import numpy as np
import pytest
import torch

from fully_async.core.types import GenRequest, SamplingParams
from fully_async.device import CPU
from fully_async.device_memory.arena import Arena, StandIn, memory_backend
from fully_async.device_memory.policy import GIB, KeepWhenFits, engine_memory_mode
from fully_async.rollout.engines.base import run_requests
from fully_async.rollout.engines.fused_decode import projection_groups, side_by_side
from fully_async.rollout.engines.hf_engine import HFEngine

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]


def test_arena_gives_memory_back_and_maps_it_again_at_the_same_addresses():
    backend = StandIn()
    arena = Arena(backend, "job/rollout/kv", 1 << 30)
    a = arena.alloc((4, 8), torch.float32)
    b = arena.alloc((3,), torch.int64)
    big = arena.alloc((20 << 20,), torch.float32)     # past the first chunk: a chunk of its own
    assert len(arena.chunks) == 2 and arena.nbytes == backend.mapped_bytes
    assert b.data_ptr() - a.data_ptr() == 512          # each allocation at a multiple of 512 bytes in its chunk
    assert float(a.abs().sum()) == 0.0                 # zeroed on allocation
    a.fill_(3.0)
    ptrs = (a.data_ptr(), b.data_ptr(), big.data_ptr())
    assert arena.release() == arena.nbytes and arena.held == 0 and backend.mapped_bytes == 0
    assert torch.isnan(a).all()                        # released memory reads as garbage, never as the old values
    with pytest.raises(RuntimeError, match="released"):
        arena.alloc((1,), torch.float32)
    assert arena.restore() == arena.nbytes and arena.held == arena.nbytes
    assert (a.data_ptr(), b.data_ptr(), big.data_ptr()) == ptrs and float(a.abs().sum()) == 0.0
    assert arena.release() and arena.release() == 0    # a second release frees nothing
    arena.close()
    small = Arena(backend, "job/rollout/state", 4096)
    with pytest.raises(MemoryError, match="job/rollout/state"):
        small.alloc((1 << 20,), torch.float32)


def test_memory_backend_choices():
    assert memory_backend(CPU)[0] is None and "cpu" in memory_backend(CPU)[1]
    assert isinstance(memory_backend(CPU, "standin")[0], StandIn)
    assert memory_backend(CPU, "none") == (None, "device_memory=none")
    with pytest.raises(ValueError, match="'vmm' is not available"):
        memory_backend(CPU, "vmm")
    with pytest.raises(ValueError, match="one of"):
        memory_backend(CPU, "cumem")


def test_keep_when_fits_frees_until_measured_then_keeps_what_fits(caplog):
    choice = KeepWhenFits("auto")
    total = 100 * GIB
    assert not choice.decide(80 * GIB, total, 10 * GIB)       # the trainer's peak is not known yet: free
    choice.other_turn_seen()
    with caplog.at_level(logging.INFO, logger="fully_async.device_memory.policy"):
        assert choice.decide(50 * GIB, total, 10 * GIB)       # 50 GiB free >= margin 10 GiB: keep
        assert choice.decide(40 * GIB, total, 10 * GIB)
        assert not choice.decide(9 * GIB, total, 10 * GIB)    # the trainer grew: free again
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "keeps its 10.00 GiB" in said[0] and "free_cache_engine_force" in said[0]
    assert "frees its memory" in said[1] and "9.0 of 100.0 GiB free" in said[1]
    assert choice.decisions == {"kept": 2, "freed": 2}
    small = KeepWhenFits("auto")
    small.other_turn_seen()
    assert not small.decide(int(1.5 * GIB), 4 * GIB, GIB)     # margin is at least 2 GiB
    assert KeepWhenFits("keep").decide(0, 0, 0) and not KeepWhenFits("free").decide(GIB, GIB, 0)
    with pytest.raises(ValueError, match="one of"):
        KeepWhenFits("sometimes")


def test_the_first_switch_keeps_the_engine_where_the_memory_models_estimate_of_the_trainer_fits(caplog):
    total = 100 * GIB
    with caplog.at_level(logging.INFO, logger="fully_async.device_memory.policy"):
        fits = KeepWhenFits("auto", estimate_bytes=40 * GIB)
        assert fits.decide(60 * GIB, total, 10 * GIB)           # 60 free >= 40 estimated + 10 margin: kept at once
        tight = KeepWhenFits("auto", estimate_bytes=40 * GIB)
        assert not tight.decide(45 * GIB, total, 10 * GIB)      # 45 < 40 + 10: the first switch frees
        tight.other_turn_seen()
        assert tight.decide(45 * GIB, total, 10 * GIB)          # measured: the trainer's peak is already held
    said = [r.getMessage() for r in caplog.records]
    assert "memory model's estimate of its peak, 40.0 GiB" in said[0] and "keeps its 10.00 GiB" in said[0]
    assert "does not fit beside the resident engine" in said[1] and "45.0 of 100.0 GiB free" in said[1]
    assert "keeps its" in said[2] and "estimate" not in said[2]
    assert not KeepWhenFits("free", estimate_bytes=0.0).decide(99 * GIB, total, GIB)   # the force key wins


def test_the_trainer_estimate_reads_the_models_config(tmp_path, random_model_dir):
    from fully_async.run.hydra_setup import load_config
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import trainer_estimate_bytes, trainer_memory
    from fully_async.device import CPU
    from fully_async.rollout.engines import _trainer_estimate

    cfg = load_config([f"actor_rollout_ref.model.path={random_model_dir}"])
    shape = Shape.from_dir(random_model_dir)
    got = _trainer_estimate(cfg, CPU)
    assert got == trainer_estimate_bytes(cfg, shape) > 1.2 * trainer_memory(cfg, shape, 1).total
    assert Shape.from_dir(str(tmp_path)) is None
    assert _trainer_estimate(load_config([f"actor_rollout_ref.model.path={tmp_path}"]), CPU) is None  # no config.json
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="config.json.*no num_hidden_layers"):
        Shape.from_dir(str(tmp_path))
    assert _trainer_estimate(load_config([f"actor_rollout_ref.model.path={tmp_path}"]), CPU) is None  # unreadable: none


@pytest.mark.parametrize("overrides, stages", [
    (["mode=async", "async_training.placement=colocated"], True),   # responses held through the trainer's turns
    (["mode=async", "async_training.placement=elastic"], False),    # lent engines park their responses at a reclaim
    (["mode=async", "async_training.placement=split"], False),      # its engines never sleep with work in flight
    (["mode=sync"], False),                                          # a sync switch has nothing in flight
])
def test_only_engines_that_sleep_with_responses_in_flight_pin_a_swap_buffer_at_start_up(overrides, stages,
                                                                                         random_model_dir,
                                                                                         monkeypatch):
    from fully_async.rollout import engines
    from fully_async.run.hydra_setup import load_config

    asked = {}
    monkeypatch.setattr("fully_async.rollout.engines.hf_engine.HFEngine",
                        lambda path, **kw: asked.update(kw) or "engine")
    cfg = load_config([*overrides, f"actor_rollout_ref.model.path={random_model_dir}"])
    assert engines.build_engine(cfg, CPU, [], 0) == "engine" and asked["stage_swaps"] is stages


@pytest.mark.parametrize("overrides, mode, why", [
    ([], "auto", "what fits stays resident"),
    (["actor_rollout_ref.rollout.free_cache_engine=false"], "keep", "free_cache_engine=false"),
    (["actor_rollout_ref.rollout.free_cache_engine_force=true"], "free", "free_cache_engine_force=true"),
    (["multi_job.pool=shared"], "free", "other jobs lease"),
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true"], "free", "offloads between turns"),
    (["actor_rollout_ref.rollout.name=vllm"], "free", "own sleep mode"),
])
def test_engine_memory_mode_of_the_config(overrides, mode, why):
    from fully_async.run.hydra_setup import load_config

    got = engine_memory_mode(load_config(overrides))
    assert got[0] == mode and why in got[1]
    private = load_config(["mode=async", "async_training.placement=colocated"])
    private.multi_job.pool = "run-colocated-1a2b3c4d"          # colocated async's own pool (run/shared_pool.py)
    assert engine_memory_mode(private)[0] == "auto"


class AddressCheckingGraphs:
    """A CPU stand-in for device graphs that holds the engine to a real graph's contract: every buffer the decode
    step reads (weights, KV cache, decode state) is at the address it had at capture time whenever it replays."""

    def __init__(self):
        self.captured, self.replays, self.engine = 0, 0, None

    def addresses(self):
        e = self.engine
        tensors = list(e.model.parameters()) + list(e.model.buffers()) + e._cache.keys + e._cache.values + \
            list(e._state.values())
        return [t.data_ptr() for t in tensors]

    def capture(self, fn, warmup: int = 1):
        for _ in range(warmup):
            fn()
        self.captured += 1
        at = self.addresses()

        def replay():
            assert self.addresses() == at, "a decode graph replayed over moved buffers"
            self.replays += 1
            fn()
        return replay


def _engine(model_dir, **kw):
    return HFEngine(model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, max_model_len=32, **kw)


def test_decode_graphs_survive_a_sleep_that_frees_the_memory(random_model_dir, monkeypatch):
    graphs = AddressCheckingGraphs()
    monkeypatch.setattr(CPU.__class__, "graphs", lambda self: graphs)
    monkeypatch.setattr(HFEngine, "_capture_graphs", lambda self: None)    # buckets captured at first use
    eng = _engine(random_model_dir, enforce_eager=False, graph_batch_sizes=[2, 4], device_memory="standin")
    graphs.engine = eng

    def groups_joined():   # the fused decode's q/k/v and gate/up weights stay views of one tensor each
        return all(side_by_side([lin.weight for lin in group]) is not None
                   for layer in eng.model.get_decoder().layers for group in projection_groups(layer))
    assert eng._fused is not None and groups_joined()
    want = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    reqs = [GenRequest(f"g{i}", p, SamplingParams(0.0, max_tokens=6)) for i, p in enumerate(PROMPTS[:3])]
    first = run_requests(eng, reqs, timeout_s=60.0)
    captured = graphs.captured
    assert captured > 0 and graphs.replays > 0
    eng.sleep(1)
    held = eng.memory.held()
    assert set(held) == {"run/rollout/weights", "run/rollout/kv", "run/rollout/state"} and not any(held.values())
    assert torch.isnan(eng.memory._region.view(torch.float32)).any()          # the arena's bytes are gone
    assert all(torch.equal(p, want[n]) for n, p in eng.model.named_parameters())   # on the host meanwhile
    assert groups_joined()
    report = eng.memory_report()
    assert report["memory/rollout/freed_gib"] > 0 and report["memory/rollout/kept_resident"] == 0.0
    assert report["memory/run/rollout/kv_gib"] == 0.0
    eng.wake_up()
    assert all(torch.equal(p, want[n]) for n, p in eng.model.named_parameters()) and groups_joined()
    again = run_requests(eng, reqs, timeout_s=60.0)
    assert graphs.captured == captured and eng.memory_report()["memory/rollout/graph_captures"] == captured
    assert {k: o.token_ids for k, o in again.items()} == {k: o.token_ids for k, o in first.items()}
    eng.sleep(1)                                     # an update while asleep lands in the host copy, then on device
    eng.update_weights({n: p * 0.5 for n, p in want.items()}, version=4)
    eng.wake_up()
    assert all(torch.equal(p, want[n] * 0.5) for n, p in eng.model.named_parameters())


@pytest.mark.parametrize("device_memory", ["standin", "none"])
def test_responses_kept_in_flight_through_a_freeing_sleep_continue_exactly(random_model_dir, device_memory):
    """pause_mode=keep, the engine's memory freed for the trainer's turn: the occupied slots' KV and decode state go
    to host memory and back; the sampled continuation equals one that never slept (token ids, log-probs, versions);
    "none" drops the cache and rebuilds it, "standin" gives the arenas back and maps them again."""
    sampling = SamplingParams(1.0, max_tokens=12)
    reqs = [GenRequest(f"k{i}", p, sampling) for i, p in enumerate(PROMPTS)]   # 5 requests, 4 slots: one waits
    want = run_requests(_engine(random_model_dir, keep_in_flight=True), reqs, timeout_s=60.0)
    eng = _engine(random_model_dir, keep_in_flight=True, device_memory=device_memory)
    eng.submit(reqs)
    got = {}
    for _ in range(5):
        got.update({o.request_id: o for o in eng.collect()})
    assert eng.num_in_flight() == 5 and int(eng._occ.sum()) == 4
    with pytest.raises(RuntimeError, match="in flight"):
        eng.sleep(1)
    eng.sleep(1, keep_in_flight=True)
    report = eng.memory_report()
    assert report["memory/rollout/swap_gib"] > 0 and report["memory/rollout/freed_switches"] == 1
    if device_memory == "none":
        assert eng._cache is None
    eng.wake_up()
    while eng.num_in_flight():
        got.update({o.request_id: o for o in eng.collect()})
    assert set(got) == set(want)
    for k, o in want.items():
        assert got[k].token_ids == o.token_ids, k
        assert got[k].log_probs == pytest.approx(o.log_probs, abs=1e-6) and got[k].versions == o.versions


def test_keep_when_fits_keeps_the_engine_resident_once_the_trainer_was_measured(random_model_dir, monkeypatch):
    free = {"bytes": 50 * GIB}
    monkeypatch.setattr(CPU.__class__, "mem_info", lambda self: (int(free["bytes"]), int(100 * GIB)))
    eng = _engine(random_model_dir, keep_when_fits=True, device_memory="standin")
    run_requests(eng, [GenRequest("a", PROMPTS[0], SamplingParams(0.0, max_tokens=4))], timeout_s=60.0)
    assert not eng.keeps_resident()                   # nobody measured the trainer yet: the first switch frees
    eng.sleep(1)
    assert not any(eng.memory.held().values())
    eng.wake_up()                                     # the trainer had its turn
    run_requests(eng, [GenRequest("b", PROMPTS[1], SamplingParams(0.0, max_tokens=4))], timeout_s=60.0)
    assert eng.keeps_resident()
    eng.sleep(1)
    assert all(eng.memory.held().values()) and eng.memory_report()["memory/rollout/kept_resident"] == 1.0
    eng.wake_up()
    free["bytes"] = 5 * GIB                            # the trainer's step grew: the engine frees again
    eng.sleep(1)
    assert not any(eng.memory.held().values())
    eng.wake_up()
    assert eng.memory_stats["freed_sleeps"] == 2 and eng.memory_stats["sleeps"] == 3
    kept = _engine(random_model_dir, free_cache_engine=False)
    assert kept.keeps_resident() and kept.memory is None


def test_an_engine_whose_switches_free_its_memory_pins_its_swap_buffer_at_start_up(random_model_dir, monkeypatch):
    from fully_async.rollout.engines import engine_memory

    made = []

    class Staging(engine_memory.HostStaging):   # (no CUDA here: the pinned flag is recorded, the buffer is plain)
        def _make(self, nbytes):
            made.append((nbytes, self.pinned))
            self.buf = torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(engine_memory, "HostStaging", Staging)
    forced = _engine(random_model_dir, device_memory="standin")
    fits = _engine(random_model_dir, device_memory="standin", keep_when_fits=True, trainer_estimate_bytes=10 * GIB)
    tight = _engine(random_model_dir, device_memory="standin", keep_when_fits=True, trainer_estimate_bytes=45 * GIB)
    assert forced.prepare_staging() is None and not made   # on the cpu nothing is pinned
    for eng in (forced, fits, tight):   # (on CUDA the decode graphs' capture at start-up makes the cache)
        run_requests(eng, [GenRequest("a", PROMPTS[0], SamplingParams(0.0, max_tokens=2))], timeout_s=60.0)
    monkeypatch.setattr(CPU.__class__, "is_accelerator", property(lambda self: True))
    monkeypatch.setattr(CPU.__class__, "mem_info", lambda self: (int(50 * GIB), int(100 * GIB)))
    kv = sum(t.numel() * t.element_size() for t in forced._cache.keys + forced._cache.values)
    assert forced.prepare_staging() == pytest.approx(0.25 * kv / GIB, rel=1e-3) and made == [(int(0.25 * kv), True)]
    assert forced.memory_report()["memory/rollout/swap_buffer_gib"] == pytest.approx(0.25 * kv / GIB, rel=1e-3)
    assert forced._staging.reserve(int(0.2 * kv)) is forced._staging.buf and len(made) == 1   # the first swap fits
    forced._staging.reserve(int(0.3 * kv))
    assert len(made) == 2 and made[1][0] == int(1.5 * int(0.3 * kv))                           # a larger one grows
    assert fits.prepare_staging() is None               # 50 GiB free >= 10 estimated + 10 margin: it stays resident
    assert tight.prepare_staging() is not None          # the first switch will free: its buffer is made now
    kept = _engine(random_model_dir, free_cache_engine=False)
    assert kept.prepare_staging() is None


def test_kv_swap_packs_only_the_written_positions():
    from fully_async.rollout.engines.engine_memory import HostStaging, KvSwap

    keys = [torch.randn(4, 2, 16, 3) for _ in range(2)]
    values = [torch.randn(4, 2, 16, 3) for _ in range(2)]
    state = {"lengths": torch.tensor([5, 0, 9, 2])}
    rows, lengths = np.array([0, 2, 3]), np.array([5, 9, 2])
    staging = HostStaging(pinned=False)
    swap = KvSwap.out(keys, values, state, rows, lengths, CPU, staging)
    assert swap._view(0).shape == (16, 2, 3)            # 5 + 9 + 2 positions, not 4 slots x 16
    assert swap.nbytes == 4 * 16 * 2 * 3 * 4 + 3 * 8 and staging.buf.numel() >= swap.nbytes
    buf = staging.buf
    assert KvSwap.out(keys, values, state, rows[:2], lengths[:2], CPU, staging).host is buf   # reused, not grown
    swap = KvSwap.out(keys, values, state, rows, lengths, CPU, staging)
    new_k = [torch.zeros_like(k) for k in keys]
    new_v = [torch.zeros_like(v) for v in values]
    new_state = {"lengths": torch.zeros(4, dtype=torch.long)}
    swap.back(new_k, new_v, new_state)
    for k, nk in zip(keys, new_k):
        for row, n in zip(rows, lengths):
            assert torch.equal(nk[row, :, :n], k[row, :, :n]) and not nk[row, :, n:].any()
        assert not nk[1].any()
    assert new_state["lengths"].tolist() == [5, 0, 9, 2]


@pytest.mark.parametrize("overrides, says", [
    (["mode=async", "async_training.placement=colocated"], "free_cache_engine_force=true to free it at every turn"),
    (["mode=sync", "actor_rollout_ref.rollout.free_cache_engine=false"], "free_cache_engine=false): set it to true"),
    (["mode=async", "async_training.placement=colocated", "actor_rollout_ref.rollout.free_cache_engine_force=true"],
     None),
    (["mode=async", "async_training.placement=split"], None),
])
def test_a_trainer_out_of_device_memory_fails_with_what_to_change(overrides, says, monkeypatch):
    from fully_async.cluster.ray_utils import RunFailed
    from fully_async.run.hydra_setup import load_config
    from fully_async.train import train_step as ts

    cfg = load_config(overrides + ["actor_rollout_ref.actor.use_dynamic_bsz=true"])

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(ts, "_train_step", oom)
    with pytest.raises(RunFailed) as info:
        ts.train_step(None, cfg, [], 0, 7, 0)
    msg = str(info.value)
    assert msg.startswith("the device ran out of memory in the trainer's update of step 7: ")
    assert "ppo_max_token_len_per_gpu" in msg and "OutOfMemoryError: CUDA out of memory. Tried" in msg
    assert "more detail" not in msg and isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert (says in msg) if says else "free_cache_engine" not in msg

    def other(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(ts, "_train_step", other)
    with pytest.raises(ValueError, match="a bug"):       # anything else passes through unchanged
        ts.train_step(None, cfg, [], 0, 7, 0)
