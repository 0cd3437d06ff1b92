"""core/batch.PackedRows: a batch's packed layout worked out on the host equals what the device path computed
(boolean-mask indexing and the position restarts), and TrainBatch.to(pack=True) carries it, select() drops it."""
import torch

from fully_async.core.batch import PackedRows, TrainBatch
from fully_async.core.varlen_attention import packed_kwargs


def test_the_host_layout_is_the_masks_real_tokens_back_to_back():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    rows = PackedRows.of(mask)
    keep = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(rows.index, keep.reshape(-1).nonzero().flatten())
    assert rows.positions.tolist() == positions[keep].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1]
    want = packed_kwargs(positions[keep][None])          # what the forward derived on the device before
    assert torch.equal(rows.cu, want["cu_seq_lens_q"]) and rows.cu.tolist() == [0, 3, 8, 9, 11]
    assert rows.max_len == want["max_length_q"] == 5


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
