"""Tensor parallelism on two GPUs (NCCL): the GPU engine tests' greedy tokens at TP = 1 and 2, with the
decode steps replayed from CUDA graphs that hold the NCCL calls and run eagerly."""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine_gpu import GRAPH_VARIANTS, assert_equal_or_near_tie, model_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("variant", list(GRAPH_VARIANTS))
def test_two_ranks_give_one_gpu_s_greedy_tokens(model_dir, variant: str, cuda_graphs: bool) -> None:  # noqa: F811
    from engine import LLM, SamplingParams

    settings = dict(model=model_dir, dtype="float32", max_num_batched_tokens=512, num_kv_blocks=1024,
                    cuda_graph_max_batch=6, cuda_graphs=cuda_graphs, **GRAPH_VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (3, 129, 700, 1100, 16, 255, 257, 64)]
    results = {}
    for tp in (1, 2):
        llm = LLM(tensor_parallel_size=tp, **settings)
        try:
            results[tp] = llm.generate(prompts, params)
            if cuda_graphs:
                assert llm.engine.runner.num_graph_steps > 0
        finally:
            llm.engine.close()
    for one, two in zip(results[1], results[2], strict=True):
        assert_equal_or_near_tie(one, two)
