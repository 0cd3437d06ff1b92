"""core/batch's rows: build_batch fills each row as its sample says; PackedRows, a batch's packed layout worked out
on the host, equals what the device path computed (boolean-mask indexing and the position restarts), and
TrainBatch.to(pack=True) carries it, select() drops it."""
import torch

from fully_async.core.batch import PackedRows, TrainBatch


def test_the_host_layout_is_the_masks_real_tokens_back_to_back():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    rows = PackedRows.of(mask)
    keep = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(rows.index, keep.reshape(-1).nonzero().flatten())
    assert rows.positions.tolist() == positions[keep].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1]
    assert rows.cu.dtype == torch.int32 and rows.cu.tolist() == [0, 3, 8, 9, 11] and rows.max_len == 5
    kw = rows.kwargs()   # what the packed forward passes on to the attention
    assert kw["cu_seq_lens_q"] is kw["cu_seq_lens_k"] is rows.cu and kw["max_length_q"] == kw["max_length_k"] == 5


def test_to_with_pack_carries_the_layout_and_select_drops_it():
    ids = torch.arange(12).view(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    zeros = torch.zeros(3, 4)
    batch = TrainBatch(ids, mask, zeros, zeros, torch.zeros(3), ["a", "b", "c"])
    moved = batch.to(torch.device("cpu"), non_blocking=True, pack=True)
    assert moved.packing is not None and moved.packing.cu.tolist() == [0, 2, 6, 7]
    assert torch.equal(ids.reshape(-1).index_select(0, moved.packing.index), ids[mask.bool()])
    assert batch.to(torch.device("cpu")).packing is None
    assert moved.select([1]).packing is None
    assert torch.equal(moved.to(torch.device("cpu")).packing.index, moved.packing.index)   # moved along


def test_build_batch_fills_each_row_as_its_sample_says():
    """The rows, filled at once from flat arrays, hold each sample's prompt + response right-padded, its behaviour
    log-probs and response mask (a multi-turn sample's own, the others' all ones) on its response only; a sample
    whose log-probs do not match its response is named."""
    import pytest

    from fully_async.core.batch import build_batch
    from fully_async.core.types import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(7):
        p, r = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(0, 9, (1,), generator=g))
        ids = torch.randint(2, 50, (p + r,), generator=g).tolist()
        mask = torch.randint(0, 2, (r,), generator=g).tolist() if i % 3 == 0 else None
        samples.append(Sample(uid=f"g{i // 2}", sample_id=f"s{i}", prompt_ids=ids[:p], response_ids=ids[p:],
                              rollout_log_probs=torch.randn(r, generator=g).tolist(), versions=[0] * r,
                              reward=float(i), response_mask=mask))
    batch = build_batch(samples, pad_token_id=-1)
    assert batch.input_ids.shape == (7, max(s.num_tokens for s in samples))
    for row, s in enumerate(samples):
        p, n = len(s.prompt_ids), s.num_tokens
        assert batch.input_ids[row, :n].tolist() == s.prompt_ids + s.response_ids
        assert (batch.input_ids[row, n:] == -1).all() and batch.attention_mask[row].tolist() == [1] * n + [0] * (
            batch.input_ids.shape[1] - n)
        want_mask = s.response_mask if s.response_mask is not None else [1] * len(s.response_ids)
        assert batch.response_mask[row, p:n].tolist() == want_mask
        assert batch.response_mask[row, :p].sum() == 0 and batch.response_mask[row, n:].sum() == 0
        assert torch.allclose(batch.rollout_log_probs[row, p:n], torch.tensor(s.rollout_log_probs))
        assert batch.rollout_log_probs[row, :p].abs().sum() == 0
    assert batch.scores.tolist() == [float(i) for i in range(7)] and batch.group_ids == [s.uid for s in samples]
    bad = samples[1]
    bad.rollout_log_probs = bad.rollout_log_probs + [0.0]
    with pytest.raises(ValueError, match=f"sample {bad.sample_id}: .* rollout_log_probs for"):
        build_batch(samples)
