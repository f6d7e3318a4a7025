"""MoE models on a GPU: the fused kernels inside the model against transformers, and CUDA-graph
decode equal to eager decode for Flash-Decoding and FFD attention. Skipped without CUDA."""
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

VARIANTS = {
    "flash": dict(enable=True, kernel="flash"),
    "ffd": dict(enable=True, kernel="ffd", delta=5.0),
}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param,
                           num_layers=3, max_position_embeddings=4096, hidden_size=256)


def test_fused_moe_model_follows_transformers(moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from engine.model.loader import load_model
    from tests.support.model_driver import PagedModelDriver

    model = load_model(moe_dir, torch.float32, torch.device("cuda"))
    hf = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 250, (300,), generator=gen).tolist()
    driver = PagedModelDriver(model, num_blocks=64, block_size=16)
    got = [driver.step({0: tokens[:290]})]              # prefill: the grouped GEMM
    got += [driver.step({0: [t]}) for t in tokens[290:]]  # decodes: the pair GEMV
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0].float()
    # The attention kernels multiply float32 as tf32, so a token whose router scores two experts
    # within ~1e-3 may pick the other one: such tokens' logits differ wholesale, all others agree.
    row_err = (torch.cat(got).cpu() - want).abs().amax(dim=-1)
    quantiles = row_err.quantile(torch.tensor([0.5, 0.9, 0.97, 1.0])).tolist()
    assert float((row_err < 2e-2).float().mean()) >= 0.97, quantiles
    assert quantiles[0] < 5e-3, quantiles


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_cuda_graph_decode_equals_eager(moe_dir: Path, variant: str) -> None:
    from engine import LLM, SamplingParams

    settings = dict(model=moe_dir, dtype="bfloat16", max_num_batched_tokens=512, num_kv_blocks=512,
                    cuda_graph_max_batch=8, **VARIANTS[variant])
    graphed, eager = LLM(cuda_graphs=True, **settings), LLM(cuda_graphs=False, **settings)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 130, 700, 33, 1500)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a, b = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)) >= len(prompts) - 1
    assert graphed.engine.runner.num_graph_steps > 0
