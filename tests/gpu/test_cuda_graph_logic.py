"""CUDA-graph bookkeeping that needs no GPU: buckets, and padding a decode batch into static buffers."""

from __future__ import annotations

import pytest
import torch

from ferrylm.model.compile.cuda_graphs import StaticDecodeInputs, graph_batch_sizes, pick_bucket
from ferrylm.model.forward_batch import ForwardBatch

BLOCK_SIZE, PAD_BLOCK = 4, 50


def _decode_batch(context_lens: list[int], first_block: int = 0) -> ForwardBatch:
    tables, next_block = [], first_block
    for c in context_lens:
        n = c // BLOCK_SIZE + 1
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return ForwardBatch.build([[7 + i] for i in range(len(context_lens))], context_lens, tables, BLOCK_SIZE)


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (48, [1, 2, 4, 8, 16, 32, 48]), (256, [1, 2, 4, 8, 16, 32, 64, 128, 256]),
])
def test_bucket_sizes(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def test_bucket_sizes_reject_nonpositive():
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_pick_bucket_smallest_that_fits():
    sizes = graph_batch_sizes(48)
    assert [pick_bucket(sizes, n) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)] == [1, 2, 4, 8, 16, 32, 48, 48, None]


def test_fill_copies_rows_and_pads_the_rest():
    inputs = StaticDecodeInputs(8, 6, PAD_BLOCK, BLOCK_SIZE, "cpu")
    batch = _decode_batch([3, 9, 0])
    inputs.fill(batch, 4)
    assert inputs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert inputs.positions[:4].tolist() == [3, 9, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == batch.slot_mapping.tolist() + [PAD_BLOCK * BLOCK_SIZE]
    assert inputs.seq_lens[:4].tolist() == [4, 10, 1, 1]
    assert inputs.block_tables[:3, :3].tolist() == batch.block_tables.tolist()
    assert inputs.block_tables[3, 0].item() == PAD_BLOCK
    view = inputs.view(4)
    assert view.is_decode_only and view.num_seqs == 4
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4] and view.logits_indices.tolist() == [0, 1, 2, 3]
    assert view.block_tables.shape == (4, 6)  # full static width: the graph's launch shapes never change


def test_smaller_batch_turns_previous_rows_into_padding():
    inputs = StaticDecodeInputs(8, 6, PAD_BLOCK, BLOCK_SIZE, "cpu")
    inputs.fill(_decode_batch([5, 6, 7, 8, 9]), 8)
    inputs.fill(_decode_batch([20], first_block=30), 2)
    assert inputs.seq_lens[:2].tolist() == [21, 1]
    assert inputs.slot_mapping[1].item() == PAD_BLOCK * BLOCK_SIZE
    assert inputs.block_tables[0, :6].tolist() == [30, 31, 32, 33, 34, 35]
    assert inputs.block_tables[1, 0].item() == PAD_BLOCK and inputs.positions[1].item() == 0


def test_views_share_storage_with_the_buffers():
    inputs = StaticDecodeInputs(4, 3, PAD_BLOCK, BLOCK_SIZE, "cpu")
    view = inputs.view(2)
    inputs.fill(_decode_batch([1, 2]), 2)
    assert view.input_ids.tolist() == [7, 8] and view.seq_lens.tolist() == [2, 3]


@pytest.mark.parametrize("reason,batch", [
    ("prefill", ForwardBatch.build([[1, 2, 3]], [0], [[0]], BLOCK_SIZE)),
    ("mixed", ForwardBatch.build([[1], [1, 2]], [4, 0], [[0, 1], [2]], BLOCK_SIZE)),
    ("too many rows", _decode_batch([1] * 5)),
    ("too many blocks", _decode_batch([30])),
])
def test_batches_that_run_eagerly(reason, batch):
    inputs = StaticDecodeInputs(4, 3, PAD_BLOCK, BLOCK_SIZE, "cpu")
    assert not inputs.fits(batch), reason
    with pytest.raises(ValueError):
        inputs.fill(batch, 4)


def test_fill_rejects_a_bucket_smaller_than_the_batch():
    inputs = StaticDecodeInputs(8, 3, PAD_BLOCK, BLOCK_SIZE, "cpu")
    with pytest.raises(ValueError):
        inputs.fill(_decode_batch([1, 2, 3]), 2)


def test_graph_runner_refuses_backends_that_are_not_graph_safe():
    from ferrylm.config import ModelConfig
    from ferrylm.model.arch.llama import LlamaForCausalLM
    from ferrylm.model.attention.torch_native import TorchNativeBackend
    from ferrylm.model.compile.cuda_graphs import CudaGraphRunner

    config = ModelConfig("llama", 32, 16, 32, 1, 2, 1, 8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, TorchNativeBackend(), 64)
    caches = [(torch.zeros(2, BLOCK_SIZE, 1, 8), torch.zeros(2, BLOCK_SIZE, 1, 8))]
    with pytest.raises(ValueError, match="supports_cuda_graphs"):
        CudaGraphRunner(model, caches, 4, 3, 1, BLOCK_SIZE)


def test_uncaptured_runner_runs_eagerly_and_capture_needs_cuda():
    from ferrylm.config import ModelConfig
    from ferrylm.model.arch.llama import LlamaForCausalLM
    from ferrylm.model.attention.torch_native import TorchNativeBackend
    from ferrylm.model.compile.cuda_graphs import CudaGraphRunner

    class GraphSafeTorch(TorchNativeBackend):  # stands in for TritonBackend on a CPU-only machine
        supports_cuda_graphs = True

    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig("llama", 32, 16, 32, 1, 2, 1, 8), GraphSafeTorch(), 64)
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    caches = [(torch.zeros(8, BLOCK_SIZE, 1, 8), torch.zeros(8, BLOCK_SIZE, 1, 8))]
    graphs = CudaGraphRunner(model, caches, 4, 3, 7, BLOCK_SIZE)
    batch = _decode_batch([2, 5])
    assert not graphs.can_replay(batch)  # nothing captured
    with torch.inference_mode():
        assert torch.equal(graphs.forward(batch), model(batch, caches))
    with pytest.raises(RuntimeError, match="CUDA"):
        graphs.capture()
