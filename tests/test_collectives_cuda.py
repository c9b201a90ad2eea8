"""The collectives on the GPU transport (skipped without CUDA): the same contract scenarios
as on the host transport, with several processes sharing one GPU (VMM heaps exchanged as
file descriptors, copy engines, stream-memory flags) and in the single-process mode."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_multiprocess
    from test_collectives_host import _scenarios, run_single_process_mode
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess
    from tests.test_collectives_host import _scenarios, run_single_process_mode

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_contract_exact_processes_sharing_one_gpu(world_size: int) -> None:
    out = run_multiprocess(_scenarios, world_size, 11, "cuda", timeout=400, env=MULTICAST_OFF)
    for r, res in enumerate(out):
        assert all(res[i] == "ok" for i in range(3)), (r, res)


def test_single_process_multi_rank_mode_cuda() -> None:
    run_single_process_mode("cuda")


@pytest.fixture(autouse=True)
def _collect_after_each_test():
    # Finalisers of CUDA resources run here, attributed to the test that left them.
    yield
    import gc

    gc.collect()
    torch.cuda.synchronize()
