"""`fdserve bench` (bench/e2e.py, bench/serve.py, bench/plots.py) and synthetic models, on CPU."""
import json
from pathlib import Path

import pytest

from bench.e2e import main
from bench.plots import plot_result
from engine.model.synthetic import synthetic_marker, synthetic_model_dir
from tests.support.tiny_models import make_tiny_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_KV = "backend.cpu_kv_cache_bytes=4000000"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", "llama")


@pytest.fixture()
def empty_config(tmp_path, monkeypatch):
    """No ./config.toml or $FDSERVE_CONFIG leaks into the run: defaults plus the test's --set."""
    monkeypatch.delenv("FDSERVE_CONFIG", raising=False)
    path = tmp_path / "config.toml"
    path.write_text("")
    return str(path)


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width = matplotlib.image.imread(str(path)).shape[:2]
    assert height > 100 and width > 100


def by_name(result):
    return {row["name"]: row for row in result["variants"]}


def test_latency_reports_each_variant_side_by_side(model_dir, empty_config, tmp_path, capsys):
    import os

    out = tmp_path / "lat.json"
    rc = main(["latency", "--model", str(model_dir), "--config", empty_config, "--set", SMALL_KV,
               "--variants", "standard,flash", "--context-len", "40", "--max-tokens", "16", "--repeat", "2",
               "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = by_name(result)
    assert result["mode"] == "latency" and result["warnings"] == [] and list(rows) == ["standard", "flash"]
    for row in rows.values():
        assert row["available"] and row["tokens"] == 16 and len(row["runs"]) == 2
        assert row["prefix_cache_hits"] == 0  # every round (warm-up included) has its own prompt
        assert 0 < row["ttft_ms"] < row["total_ms"] and row["tpot_ms"] > 0
        # (total - TTFT) / (tokens - 1), in ms
        assert row["tpot_ms"] == pytest.approx((row["total_ms"] - row["ttft_ms"]) / 15, rel=1e-6)
    assert "standard attention" in rows["standard"]["attention"] and "split-KV" in rows["flash"]["attention"]
    assert rows["standard"]["speedup_vs_standard"] == 1.0
    assert rows["flash"]["speedup_vs_standard"] == pytest.approx(rows["standard"]["tpot_ms"] / rows["flash"]["tpot_ms"])
    # Each variant ran in a process of its own, not beside the one before it (nor in this one).
    processes = {row["process"] for row in rows.values()}
    assert len(processes) == 2 and os.getpid() not in processes
    table = capsys.readouterr().out
    assert "| standard |" in table and "| flash |" in table
    assert_png(out.with_suffix(".png"))


def test_concurrency_warns_on_short_decode_and_shows_unavailable_variants(model_dir, empty_config, tmp_path,
                                                                          capsys):
    out = tmp_path / "conc.json"
    # fixed_max_value = true without a calibration file: the engine refuses fdpp, not standard.
    rc = main(["concurrency", "--model", str(model_dir), "--config", empty_config, "--set", SMALL_KV,
               "--set", "flashdecoding.fixed_max_value=true", "--variants", "standard,fdpp",
               "--num-requests", "3", "--context-len", "24", "--max-tokens", "4", "--repeat", "1",
               "--warmup", "0", "--out", str(out), "--no-plot"])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = by_name(result)
    assert rows["standard"]["available"] and rows["standard"]["tokens"] == 3 * 4
    assert rows["standard"]["tok_s"] > 0 and rows["standard"]["wall_s"] > 0
    assert not rows["fdpp"]["available"] and "calibration" in rows["fdpp"]["reason"]
    assert rows["fdpp"]["speedup_vs_standard"] is None
    assert len(result["warnings"]) == 1 and "max_tokens=4" in result["warnings"][0]
    captured = capsys.readouterr()
    assert "warning: max_tokens=4" in captured.err
    assert "| fdpp | unavailable: " in captured.out and "WARNING" in captured.out
    assert not out.with_suffix(".png").exists()


def test_prefill_times_the_first_token_per_length_beside_transformers(model_dir, empty_config, tmp_path, capsys):
    out = tmp_path / "prefill.json"
    rc = main(["prefill", "--model", str(model_dir), "--config", empty_config, "--set", SMALL_KV,
               "--variants", "flash", "--transformers", "--context-lens", "90,24", "--max-tokens", "5",
               "--repeat", "2", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = by_name(result)
    assert result["mode"] == "prefill" and result["settings"]["context_lens"] == [24, 90]
    ours, hf = rows["flash"], rows["transformers"]
    assert ours["prefix_cache_hits"] == 0   # a fresh prompt per length and repeat
    for row in (ours, hf):
        assert [p["context_len"] for p in row["points"]] == [24, 90]
        for point in row["points"]:
            low, high = point["ttft_ms_range"]
            assert len(point["runs"]) == 2 and low <= point["ttft_ms"] <= high
    for point, hf_point in zip(ours["points"], hf["points"], strict=True):
        assert point["tpot_ms"] > 0
        assert point["ttft_vs_transformers"] == pytest.approx(point["ttft_ms"] / hf_point["ttft_ms"])
    assert "TTFT ms @ 90" in capsys.readouterr().out
    assert_png(out.with_suffix(".png"))


def test_prefill_rejects_bad_lengths(capsys):
    with pytest.raises(SystemExit):
        main(["prefill", "--context-lens", "0,12"])
    assert "positive context lengths" in capsys.readouterr().err


def test_serve_sweep_against_a_live_server(model_dir, tmp_path):
    from engine import AsyncEngine
    from server.app.build import build_app
    from tests.support.server_harness import LiveServer, tiny_config

    config = tiny_config(model_dir, **{"api.api_key": "bench-key", "model.served_model_name": "tiny-bench"})
    engine = AsyncEngine(config)
    engine.start()
    out = tmp_path / "serve.json"
    try:
        with LiveServer(build_app(config, engine)) as live:
            rc = main(["serve", "--url", live.base_url, "--api-key", "bench-key", "--concurrency", "1,3",
                       "--prompt-len", "120", "--max-tokens", "6", "--rounds", "1", "--out", str(out)])
    finally:
        engine.shutdown()
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny-bench" and [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert level["failed"] == 0 and level["requests"] == level["concurrency"]
        assert level["output_tokens"] == 6 * level["concurrency"]  # from the usage chunks
        assert level["output_tok_s"] > 0
        for metric in ("ttft", "tpot", "itl"):
            assert 0 < level[f"{metric}_ms_p50"] <= level[f"{metric}_ms_p99"]
        assert 90 <= level["mean_prompt_tokens"] <= 150  # calibrated to ~120 through the server
    assert_png(out.with_suffix(".png"))


def test_serve_without_a_server_fails_cleanly(tmp_path, capsys):
    from tests.support.server_harness import free_port

    out = tmp_path / "fail.json"
    rc = main(["serve", "--url", f"http://127.0.0.1:{free_port()}/v1", "--concurrency", "1",
               "--timeout", "5", "--out", str(out)])
    assert rc == 1 and not out.exists()
    assert "cannot run the sweep" in capsys.readouterr().err


def test_serve_level_summary_counts_failed_requests():
    from bench.serve import RequestRecord, summarise_level

    ok = RequestRecord(ok=True, ttft_s=0.1, latency_s=0.5, itl_s=[0.1, 0.1, 0.2], completion_tokens=5)
    level = summarise_level(2, [ok, RequestRecord(ok=False, error="HTTP 500: boom")], wall_s=1.0)
    assert level["failed"] == 1 and level["first_error"] == "HTTP 500: boom" and level["output_tokens"] == 5
    assert level["tpot_ms_p50"] == pytest.approx(100.0) and level["itl_ms_p50"] == pytest.approx(100.0)
    assert level["ttft_ms_p99"] == pytest.approx(100.0) and level["output_tok_s"] == pytest.approx(5.0)


def test_plot_marks_unavailable_variants(tmp_path):
    result = {"mode": "latency", "model": "m", "machine": {"device": "cpu"}, "warnings": [],
              "settings": {"context_len": 512, "max_tokens": 32},
              "variants": [{"name": "standard", "available": True, "tpot_ms": 10.0, "speedup_vs_standard": 1.0},
                           {"name": "flash", "available": True, "tpot_ms": 5.0, "speedup_vs_standard": 2.0},
                           {"name": "ffd", "available": False, "reason": "not built"}]}
    assert_png(plot_result(result, tmp_path / "p" / "lat.png"))


def test_synthetic_8b_folder_has_the_shape_and_no_weights(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from engine.text.tokenizer import Tokenizer

    monkeypatch.setenv("FDSERVE_CACHE_DIR", str(tmp_path))
    folder = synthetic_model_dir("synthetic:llama-3.1-8b")
    assert synthetic_model_dir("synthetic:llama-3.1-8b") == folder  # cached
    cfg = AutoConfig.from_pretrained(folder)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert synthetic_marker(folder) == {"preset": "llama-3.1-8b", "seed": 0, "version": 1}
    assert not list(folder.glob("*.safetensors")) and sum(p.stat().st_size for p in folder.iterdir()) < 1e6
    tok = Tokenizer.from_pretrained(folder)
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    with pytest.raises(ValueError, match="synthetic:tiny"):
        synthetic_model_dir("synthetic:llama-9000")


def test_synthetic_tiny_runs_through_the_engine_deterministically(tmp_path, monkeypatch):
    from bench.e2e import build_llm, run_requests
    from engine import load_config

    monkeypatch.setenv("FDSERVE_CACHE_DIR", str(tmp_path))
    config = load_config(None, {"model.name": "synthetic:tiny", "backend.cpu_kv_cache_bytes": 4_000_000})
    outputs = []
    for seed_name in ("synthetic:tiny", "synthetic:tiny", "synthetic:tiny@1"):
        config.model.name = seed_name
        llm = build_llm(config, "standard")
        params_before = sum(float(p.abs().sum()) for p in llm.engine.model.parameters())
        assert params_before > 0
        outputs.append(llm.generate([list(range(65, 90))], _greedy(6))[0].token_ids)
        timings, _ = run_requests(llm.engine, [list(range(40, 70))], 5)
        assert timings[0].tokens == 5 and timings[0].tpot_ms > 0
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6  # same seed, same weights
    assert outputs[0] != outputs[2]  # another seed, other weights


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_cli_registration_parses_each_mode():
    """What server/cli/main.py does: `add_arguments` on the `bench` subparser, then `run(args)`."""
    import argparse

    from bench.e2e import add_arguments

    parser = argparse.ArgumentParser(prog="fdserve")
    add_arguments(parser.add_subparsers(dest="command").add_parser("bench"))
    args = parser.parse_args(["bench", "serve", "--concurrency", "1,4"])
    assert (args.command, args.mode, args.concurrency, args.url) == ("bench", "serve", [1, 4],
                                                                     "http://127.0.0.1:8000/v1")
    args = parser.parse_args(["bench", "latency", "--variants", "standard,fdpp,ffd"])
    assert args.variants == ["standard", "fdpp", "ffd"] and args.max_tokens >= 16
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "latency", "--variants", "standard,turbo"])
