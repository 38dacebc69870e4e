"""tq_hf_cache.hf.distributed.shutdown: ends a process group (gloo here; on CUDA it frees the compiled steps' graphs
first, which the tensor-parallel runs on GPUs check), and does nothing without one."""

import torch

import tq_hf_cache.hf.distributed


def test_shutdown_destroys_the_process_group_and_is_a_no_op_without_one(tmp_path):
    tq_hf_cache.hf.distributed.shutdown()  # none yet
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert torch.distributed.is_initialized()
    tq_hf_cache.hf.distributed.shutdown()
    assert not torch.distributed.is_initialized()
    tq_hf_cache.hf.distributed.shutdown()
