"""A prefill step runs the model's last layer over its sampled rows alone (`OutputRows`): every row's
K/V is still stored there, and the sampled rows' logits are transformers' at those positions."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_reference import ReferenceBackend
from engine.model.loader import load_model
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence
from engine.worker.model_runner import ModelRunner
from tests.support.tiny_models import make_tiny_model

BLOCK = 16


class CountingBackend(ReferenceBackend):
    """The reference backend, recording (layer, query rows) of every prefill call."""

    def __init__(self) -> None:
        super().__init__("counting")
        self.prefills: list[tuple[int, int]] = []

    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        self.prefills.append((layer_idx, q.shape[0]))
        return super().prefill(layer_idx, q, k_cache, v_cache, metadata, scale=scale)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("rows") / "llama", "llama")
    return model_dir, load_model(model_dir, torch.float32, torch.device("cpu"))


def _runner(model: torch.nn.Module, backend: ReferenceBackend) -> ModelRunner:
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, BLOCK, backend)
    runner.allocate_kv_cache(24)
    # Garbage in every page: a last-layer K/V that was not stored would be read as it.
    runner.k_cache.normal_(0, 100, generator=torch.Generator().manual_seed(7))
    runner.v_cache.normal_(0, 100, generator=torch.Generator().manual_seed(8))
    return runner


def _sequence(name: str, tokens: list[int], pages: list[int], logprobs: bool = False) -> Sequence:
    seq = Sequence(name, tokens, SamplingParams(max_tokens=1, prompt_logprobs=1 if logprobs else None))
    seq.block_table = pages
    return seq


def _schedule(seq: Sequence, num_tokens: int) -> Sequence:
    seq.num_scheduled_tokens = num_tokens
    return seq


def _done(seq: Sequence) -> None:
    seq.num_computed_tokens += seq.num_scheduled_tokens


def test_chunked_prompts_sample_transformers_logits_with_the_last_layer_over_sampled_rows(tiny) -> None:
    """A's 45-token prompt in chunks of 29 and 16, B's 13 tokens in the second step beside A's last chunk
    (pages shuffled): the first step samples nothing and never attends in the last layer; the second
    attends there for its two sampled rows alone, and both rows are transformers' logits."""
    model_dir, model = tiny
    backend = CountingBackend()
    runner = _runner(model, backend)
    num_layers = len(runner.attention_layers)
    seq_a, seq_b = _tokens(45, seed=1), _tokens(13, seed=2)
    a = _sequence("a", seq_a, [17, 3, 11])
    b = _sequence("b", seq_b, [5])

    first = runner.execute([_schedule(a, 29)])
    assert first.sampled_seqs == [] and first.logits.numel() == 0
    assert [layer for layer, _ in backend.prefills] == list(range(num_layers - 1))   # no last-layer attention
    _done(a)

    backend.prefills.clear()
    second = runner.execute([_schedule(a, 16), _schedule(b, 13)])
    assert second.sampled_seqs == [a, b]
    assert backend.prefills[:-1] == [(layer, 29) for layer in range(num_layers - 1)]
    assert backend.prefills[-1] == (num_layers - 1, 2)
    expected = torch.stack([_hf_logits(model_dir, seq_a)[-1], _hf_logits(model_dir, seq_b)[-1]])
    torch.testing.assert_close(second.logits, expected, atol=1e-4, rtol=0)


def test_prompt_logprobs_keep_every_row_through_the_last_layer(tiny) -> None:
    """A step that scores prompt tokens reads every row's final hidden state: no row is dropped."""
    model_dir, model = tiny
    backend = CountingBackend()
    runner = _runner(model, backend)
    tokens = _tokens(20, seed=3)
    seq = _sequence("p", tokens, [9, 2], logprobs=True)
    result = runner.execute([_schedule(seq, 20)])
    assert backend.prefills[-1] == (len(runner.attention_layers) - 1, 20)
    [part] = result.prompt_hidden
    assert part.hidden.shape[0] == 19
    expected = _hf_logits(model_dir, tokens)
    torch.testing.assert_close(runner.prompt_logits(part, 0, 19), expected[:19], atol=1e-4, rtol=0)
    torch.testing.assert_close(result.logits[0], expected[-1], atol=1e-4, rtol=0)
