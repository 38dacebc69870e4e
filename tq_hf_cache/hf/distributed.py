"""Ending a tensor-parallel run (torchrun, `tp_plan="auto"`) cleanly.

A CUDA graph that captured an NCCL collective holds a reference on its communicator until the graph is destroyed,
and `destroy_process_group` waits for those references (NCCL's `ncclCommDestroy`): a process whose compiled steps
replayed such graphs (`generate` compiles a static cache's step with CUDA graphs) never exits if the graphs outlive
the process group. `shutdown` frees them first.
"""

from __future__ import annotations

import gc

import torch

__all__ = ["shutdown"]


def shutdown() -> None:
    """Free torch.compile's CUDA graphs (they may hold NCCL communicators), then destroy the default process group.
    A no-op without one. Call it at the end of every rank, after the last compiled step.

    Example:
        >>> import tq_hf_cache.hf.distributed
        >>> tq_hf_cache.hf.distributed.shutdown()    # at the end of a torchrun script
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.synchronize()
    torch.distributed.destroy_process_group()
