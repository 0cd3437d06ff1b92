"""The embedded engine's packed prefill on an Ascend NPU, before it meets one: under the test-only NPU stand-in
(tests/npu_standin: npu tensors as PrivateUse1 tensors over CPU memory, torch_npu.npu_fusion_attention over sdpa) a
bfloat16 engine prefills packed by default, through npu_fusion_attention in the TND layout with the bottom-right
causal mode, and splits a prompt longer than its budget into chunks over steps; every greedy output equals the same
engine's padded prefill (packed_prefill=False).  The run is a child process: registering torch.npu cannot be undone."""
import subprocess
import sys
import textwrap

from npu_standin_helpers import REPO, read_log, standin_env


def test_an_npu_engine_prefills_packed_and_chunked_through_npu_fusion_attention(random_model_dir, tmp_path):
    code = textwrap.dedent(f"""
        import torch, torch_npu
        from fully_async.core.types import GenRequest, SamplingParams
        from fully_async.device import NPU
        from fully_async.rollout.engines.hf_engine import HFEngine

        prompts = [list(range(2, 2 + n)) for n in (3, 9, 5, 23, 2)]        # 23 > the 8-token budget: 3 chunks

        def run(packed):
            eng = HFEngine({random_model_dir!r}, NPU, dtype="bfloat16", max_num_seqs=4, eos_token_ids=[],
                           pad_token_id=0, packed_prefill=packed, max_num_batched_tokens=8, enforce_eager=True)
            eng.submit([GenRequest(f"r{{i}}", p, SamplingParams(0.0, max_tokens=6)) for i, p in enumerate(prompts)])
            outs, chunked = {{}}, False
            for _ in range(100):
                outs.update((o.request_id, o.token_ids) for o in eng.collect())
                chunked = chunked or eng._chunk is not None
                if len(outs) == len(prompts):
                    return eng.packed_prefill, chunked, outs
            raise AssertionError(f"unfinished: {{sorted(outs)}}")

        packed, chunked, got = run(None)
        assert packed and chunked, (packed, chunked)
        assert run(False)[2] == got
        print("ok", sorted(got))
    """)
    env = standin_env(str(tmp_path / "log.jsonl"), FA_NPU_STANDIN_TENSORS="npu")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
    fused = [e for e in read_log(str(tmp_path / "log.jsonl")) if e["event"] == "npu_fusion_attention"]
    assert [(e["layout"], e["causal"], e["sparse_mode"]) for e in fused] == [("TND", True, 3)], fused
    assert not [e for e in read_log(str(tmp_path / "log.jsonl")) if e["event"] == "violation"]
