"""`fdserve calibrate` writes a per-layer φ file that `fixed_max_value = true` then runs with."""
import json

from engine import LLM, SamplingParams
from server.cli.main import main
from tests.support.tiny_models import make_tiny_model


def test_calibrate_then_serve_with_fixed_phi(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "phi.json"
    code = main(["calibrate", "--model", str(model_dir), "--text", str(corpus), "--output", str(out),
                 "--prompt-tokens", "300", "--decode-tokens", "4",
                 "--set", "backend.cpu_kv_cache_bytes=33554432"])
    assert code == 0
    data = json.loads(out.read_text())
    assert len(data["phi"]) == 2 and all(isinstance(x, float) for x in data["phi"])
    assert all(layer["rows"] > 300 for layer in data["layers"])  # every prefill and decode row counted

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = [[(5 * j) % 250 + 3 for j in range(150)]]
    common = dict(model=model_dir, cpu_kv_cache_bytes=32 << 20)
    dense = LLM(**common, enable=False).generate(prompt, params)[0]
    fdpp = LLM(**common, enable=True, async_softmax=True, fixed_max_value=True, calibration_file=str(out))
    assert "per layer from" in fdpp.engine.backend.name
    assert fdpp.generate(prompt, params)[0].token_ids == dense.token_ids
