"""scripts/bench_varlen_attention.py's workload and work count (its kernels are CUDA-only; GPU calls run it)."""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_micro_batches_hold_the_whole_update_within_the_token_budget_and_work_counts_causal_pairs():
    import bench_varlen_attention as bench

    batches = bench.workload_micro_batches(512, 16, 3072, 32768, seed=0)
    lengths = [n for b in batches for n in b]
    assert len(lengths) == 512 and all(2 <= n <= 16 + 3072 for n in lengths)
    assert all(sum(b) <= 32768 for b in batches) and len(batches) >= sum(lengths) // 32768 + 1
    assert 700 < sum(lengths) / 512 < 1300            # the lognormal workload's mean (~978) plus a prompt
    # a 4-token sequence: 10 allowed pairs; a 2-query chunk after 3 cached keys: 4 + 5 pairs
    assert bench.causal_flops([4], [4], heads=1, head_dim=1) == 4 * 10
    assert bench.causal_flops([2], [5], heads=2, head_dim=3) == 4 * 9 * 2 * 3
    assert bench.main(["--out", os.devnull]) == 2     # no CUDA here: a clear refusal, not a traceback


def test_a_case_times_each_kernel_and_sets_the_others_against_the_first():
    """On the CPU the packed entry (what the package runs) is the per-sequence sdpa fallback: it agrees with the
    bottom-right sdpa exactly; FlashAttention and cuDNN do not run here and are recorded as failed, not raised."""
    import bench_varlen_attention as bench

    row = bench.run_case("chunk", [5], [9], ["packed", "sdpa_lower_right", "flash", "cudnn"], 4, 2, 8, True, 0, 1,
                         device="cpu")
    ours, sdpa = row["kernels"]["packed"], row["kernels"]["sdpa_lower_right"]
    assert ours["forward_ms"] > 0 and ours["backward_ms"] is not None
    assert max(sdpa["max_abs_diff_vs_packed"].values()) == 0.0
    assert "error" in row["kernels"]["cudnn"] and "error" in row["kernels"]["flash"]
    two = bench.run_case("mb", [5, 3], [5, 3], ["packed", "sdpa_lower_right"], 4, 2, 8, False, 0, 1, device="cpu")
    assert "one sequence" in two["kernels"]["sdpa_lower_right"]["error"]


def test_the_flash_entry_is_flashattention_itself_not_the_packages_pick(monkeypatch):
    """packed_causal_attention runs the Triton kernels on Hopper: a "flash" column through it timed Triton's."""
    import bench_varlen_attention as bench
    import torch

    from fully_async.core import varlen_attention

    called = []
    monkeypatch.setattr(varlen_attention, "flash_call", lambda *a: called.append(len(a)) or a[0])
    monkeypatch.setattr(varlen_attention, "packed_causal_attention", lambda *a: 1 / 0)
    q, cu = torch.zeros(4, 2, 8), torch.tensor([0, 4])
    assert bench.KERNELS["flash"](q, q[:, :1], q[:, :1], cu, cu, 4, 4, 0.5) is not None
    assert called == [8]
