"""Flat GEMM / GEMV kernels, the adaptive dispatcher, the linear layers' matmul hook, `fdserve tune`.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py) at small odd shapes, so
N and K tails, several K splits and several M tiles all occur; speed is `bench/matmul.py`'s job.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from engine.config import FlashDecodingConfig
from engine.model import layers
from kernels.gemm import dispatch
from kernels.gemm.dispatch import CUBLAS, AdaptiveMatmul, Choice, MatmulTable, default_table_path, load_table
from kernels.gemm.matmul import GEMV_MAX_M, MatmulConfig, default_config, flat_gemm, gemv, matmul_ref, plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative (Frobenius) error vs float64: fp32 is exact up to summation order in the interpreter
# (tf32 on a GPU); half outputs add one rounding (2^-11 fp16; 2^-8 bf16, which the interpreter truncates).
TOL = {torch.float32: 1e-6 if DEVICE == "cpu" else 5e-3, torch.float16: 1e-3, torch.bfloat16: 8e-3}
N, K = 40, 200       # neither a multiple of the N tile (16) nor of the K tile (32)
SMALL = MatmulConfig(block_m=16, block_n=16, block_k=32, split_k=1, num_stages=2)


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# (M, dtype, bias, split_k, double_buffer): odd M around the 16-row tile, every dtype with and
# without bias, split-K on (several splits, the last one short) and off, one and two stages.
CASES = [
    (1, torch.float32, False, 1, True), (3, torch.float32, True, 3, False), (7, torch.float16, True, 1, False),
    (16, torch.float16, False, 4, True), (17, torch.bfloat16, True, 3, True), (17, torch.float32, False, 1, False),
    (1, torch.bfloat16, False, 2, False), (3, torch.float16, True, 2, True), (7, torch.bfloat16, True, 3, True),
]


@pytest.mark.parametrize("m,dtype,bias,split_k,double_buffer", CASES)
def test_flat_gemm_matches_float64(m, dtype, bias, split_k, double_buffer):
    x, w, b = operands(m, N, K, dtype, bias)
    cfg = MatmulConfig(block_m=16, block_n=16, block_k=32, split_k=split_k, num_stages=2)
    p = plan("flat", m, N, K, cfg, double_buffer)
    assert p.num_splits == split_k and p.num_stages == (2 if double_buffer else 1)
    out = flat_gemm(x, w, b, config=cfg, double_buffer=double_buffer)
    assert out.dtype == dtype and out.shape == (m, N)
    assert rel_err(out, matmul_ref(x, w, b, torch.float64)) < TOL[dtype]


@pytest.mark.parametrize("m,dtype,bias,split_k,double_buffer",
                         [c for c in CASES if c[0] <= GEMV_MAX_M] + [(4, torch.bfloat16, False, 1, True),
                                                                      (8, torch.float32, True, 2, False)])
def test_gemv_matches_float64(m, dtype, bias, split_k, double_buffer):
    x, w, b = operands(m, N, K, dtype, bias, seed=1)
    cfg = MatmulConfig(block_n=16, block_k=32, split_k=split_k, num_stages=2)
    assert plan("gemv", m, N, K, cfg, double_buffer).grid == (3, split_k, 1)
    out = gemv(x, w, b, config=cfg, double_buffer=double_buffer)
    assert out.dtype == dtype and out.shape == (m, N)
    assert rel_err(out, matmul_ref(x, w, b, torch.float64)) < TOL[dtype]


@pytest.mark.parametrize("block_n,block_k,m", [(1, 256, 1), (2, 256, 2), (4, 512, 1)])
def test_gemv_whole_rows_in_one_step(block_n, block_k, m):
    """The tune's GEMV tiles that stream a few rows whole: BLOCK_K >= K (one masked step), N not a
    multiple of BLOCK_N (odd N with 2- and 4-row tiles), 1-row tiles."""
    n = 37
    x, w, b = operands(m, n, K, torch.float32, True, seed=4)
    cfg = MatmulConfig(block_n=block_n, block_k=block_k, num_stages=3, num_warps=8)
    assert plan("gemv", m, n, K, cfg, True).grid == (-(-n // block_n), 1, 1)
    assert rel_err(gemv(x, w, b, config=cfg), matmul_ref(x, w, b, torch.float64)) < TOL[torch.float32]


def test_even_k_strided_and_batched_inputs():
    """K a multiple of the tile (the unmasked loop), x a strided view with leading dims."""
    base, w, b = operands(6, 24, 96 + 5, torch.float16, True, seed=2)
    x = base[:, :96].reshape(2, 3, 96)            # row stride 101, not 96
    w = w[:, :96].contiguous()
    ref = matmul_ref(x.reshape(6, 96), w, b, torch.float64).reshape(2, 3, 24)
    for fn in (flat_gemm, gemv):
        out = fn(x, w, b, config=SMALL)
        assert out.shape == (2, 3, 24) and rel_err(out, ref) < TOL[torch.float16]


def test_split_k_is_deterministic_and_defaults_work():
    x, w, b = operands(5, N, 256, torch.float32, True, seed=3)
    cfg = MatmulConfig(block_n=16, block_k=32, split_k=4, num_stages=2)
    assert torch.equal(flat_gemm(x, w, b, config=cfg), flat_gemm(x, w, b, config=cfg))
    ref = matmul_ref(x, w, b, torch.float64)
    for fn in (flat_gemm, gemv):      # config=None: the vendor default (the interpreter's on CPU)
        assert rel_err(fn(x, w, b), ref) < TOL[torch.float32]


def test_kernels_reject_misuse():
    x, w, _ = operands(GEMV_MAX_M + 1, N, K, torch.float32, False)
    with pytest.raises(ValueError, match="gemv handles"):
        gemv(x, w)
    with pytest.raises(ValueError, match="does not match"):
        flat_gemm(x.half(), w)
    with pytest.raises(ValueError, match="num_stages"):
        MatmulConfig(num_stages=1)
    with pytest.raises(ValueError, match="power of two"):
        MatmulConfig(block_n=48)
    with pytest.raises(ValueError, match="unknown"):
        MatmulConfig.from_dict({"block_n": 32, "stages": 3})


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_default_configs_fill_an_h200(k, n, m):
    """FD++'s parallelism rule: at Llama-3.1-8B shapes, tiles × splits ≥ 2 × 132 SMs (or K can't split more)."""
    for impl in ("gemv", "flat") if m <= GEMV_MAX_M else ("flat",):
        cfg = default_config(impl, m, n, k, 132)
        p = plan(impl, m, n, k, cfg, True)
        ctas = p.grid[0] * p.grid[1] * p.grid[2]
        assert ctas >= 2 * 132 or k // p.k_per_split < 4
        assert p.num_stages >= 2 and plan(impl, m, n, k, cfg, False).num_stages == 1
        assert impl == "gemv" or cfg.block_m == 16


# ----- dispatcher ----------------------------------------------------------------------------

def flat_cfg(bn: int = 16) -> MatmulConfig:
    return MatmulConfig(block_m=16, block_n=bn, block_k=32, split_k=2, num_stages=2)


def make_table(gpu: str = "Test GPU", dtype: str = "float32") -> MatmulTable:
    gemv_cfg = MatmulConfig(block_n=16, block_k=32, num_stages=2)
    per_m = {1: Choice("gemv", gemv_cfg), 2: Choice("gemv", gemv_cfg), 4: Choice("flat", flat_cfg()),
             8: Choice("flat", flat_cfg(32)), 16: CUBLAS, 32: Choice("flat", flat_cfg()),
             64: Choice("flat", flat_cfg()), 512: Choice("flat", flat_cfg())}
    table = MatmulTable(gpu, dtype, True, choices={(K, N): per_m}, names={(K, N): "qkv_proj"})
    table.timings[(K, N)] = {1: {"cublas": 20.0, "gemv": 9.0}}
    return table


def test_dispatcher_follows_the_table():
    mm = AdaptiveMatmul(make_table(), gpu="Test GPU", dtype=torch.float32, double_buffer=True, source="t")
    expect = {1: "gemv", 2: "gemv", 3: "flat", 4: "flat", 5: "flat", 8: "flat",
              9: "cublas", 15: "cublas", 16: "cublas", 31: "cublas",   # a neighbour chose cuBLAS
              32: "flat", 33: "flat", 255: "flat", 256: "flat",       # both neighbours chose flat
              257: "cublas", 512: "cublas"}                         # M > 256 never leaves cuBLAS
    assert {m: mm.choose(m, N, K).impl for m in expect} == expect
    assert mm.choose(5, N, K).config == flat_cfg(32)      # the larger neighbour's config
    assert mm.choose(1, N + 1, K) == CUBLAS               # a shape the table does not have
    assert mm.ranges(N, K) == "gemv M<=2, flat M<=8, cublas M<=31, flat M<=256, cublas M>256"
    assert mm.problem is None and "qkv_proj 200->40: gemv M<=2, flat M<=8" in mm.describe()


def test_dispatcher_runs_the_chosen_kernel(monkeypatch):
    calls: list[str] = []
    for name, fn in (("gemv", gemv), ("flat_gemm", flat_gemm)):
        monkeypatch.setattr(dispatch, name, lambda *a, _n=name, _f=fn, **kw: calls.append(_n) or _f(*a, **kw))
    mm = AdaptiveMatmul(make_table(), gpu="Test GPU", dtype=torch.float32, double_buffer=False, source="t")
    for m, expected in ((1, "gemv"), (7, "flat_gemm"), (16, None), (300, None)):
        x, w, b = operands(m, N, K, torch.float32, True, seed=m)
        calls.clear()
        out = mm(x, w, b)
        assert calls == ([expected] if expected else [])
        assert rel_err(out, matmul_ref(x, w, b, torch.float64)) < TOL[torch.float32]
    x, w, _ = operands(1, N, K, torch.float64, False)
    calls.clear()
    mm(x, w)
    assert calls == []      # a dtype the table was not measured in: F.linear


@pytest.mark.parametrize("problem,table,match", [
    ("missing", None, "no matmul table at"),
    ("other gpu", make_table(gpu="Other GPU"), "measured on 'Other GPU'"),
    ("other dtype", make_table(dtype="bfloat16"), "measured in bfloat16"),
])
def test_unusable_table_means_cublas_and_says_so(tmp_path, problem, table, match):
    path = tmp_path / "table.json"
    if table is not None:
        path.write_text(json.dumps(table.to_json()))
    mm = AdaptiveMatmul.from_file("Test GPU", torch.float32, double_buffer=True, path=path)
    assert all(mm.choose(m, N, K) == CUBLAS for m in (1, 2, 4, 8))
    text = mm.describe({"qkv_proj": (K, N)})
    assert match in mm.problem and match in text and "cuBLAS (F.linear) for every linear layer" in text


def test_table_file_round_trip_and_errors(tmp_path, monkeypatch):
    table = make_table()
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    again = load_table(path)
    assert again.choices == table.choices and again.names == table.names and again.timings[(K, N)][1]["gemv"] == 9.0
    path.write_text('{"version": 1, "gpu": "x"}')
    with pytest.raises(ValueError, match="re-run `fdserve tune`"):
        load_table(path)
    monkeypatch.setenv("FDSERVE_CACHE_DIR", str(tmp_path))
    assert default_table_path("NVIDIA H200 (MIG 1g)") == tmp_path / "matmul_table-NVIDIA_H200_MIG_1g_.json"
    with pytest.raises(ValueError, match="needs a config"):
        Choice("flat")


def test_the_shipped_h200_table_is_used_until_this_machine_tunes_its_own(tmp_path, monkeypatch):
    """No table of its own: an H200 reads the table shipped in the package (and says so); another GPU
    gets none; once `fdserve tune` has written one, that one wins."""
    from kernels.gemm.dispatch import find_table_path, shipped_table_path

    monkeypatch.setenv("FDSERVE_CACHE_DIR", str(tmp_path))
    shipped = shipped_table_path("NVIDIA H200")
    assert shipped.is_file() and find_table_path("NVIDIA H200") == shipped
    mm = AdaptiveMatmul.from_file("NVIDIA H200", torch.bfloat16, double_buffer=True)
    assert mm.problem is None and mm.table.gpu == "NVIDIA H200"
    o_proj = (4096, 4096)
    assert {m: c.impl for m, c in mm.table.choices[o_proj].items()}[1] == "gemv"
    assert mm.choose(1, 4096, 4096).impl == "gemv" and mm.choose(64, 4096, 4096) == CUBLAS
    assert "the table shipped for this GPU" in mm.describe({"o_proj": o_proj})
    assert find_table_path("NVIDIA A100-SXM4-80GB") == default_table_path("NVIDIA A100-SXM4-80GB")
    own = default_table_path("NVIDIA H200")
    own.write_text(json.dumps(make_table().to_json()))
    assert find_table_path("NVIDIA H200") == own


# ----- linear layers -------------------------------------------------------------------------

def fd(enable=True, adaptive=True, double_buffer=True) -> FlashDecodingConfig:
    return FlashDecodingConfig(enable=enable, adaptive_matmul=adaptive, double_buffer=double_buffer)


@pytest.mark.parametrize("enable,adaptive,reason", [
    (False, True, "enable = false"), (True, False, "adaptive_matmul = false"), (True, True, "need a GPU")])
def test_layers_use_f_linear_on_cpu_or_when_off(monkeypatch, caplog, enable, adaptive, reason):
    monkeypatch.setattr(layers, "_matmul", None)
    with caplog.at_level(logging.INFO, logger="engine.model.layers"):
        text = layers.configure_matmul(fd(enable, adaptive), torch.device("cpu"), torch.float32)
    assert layers._matmul is F.linear and reason in text and text in caplog.text


def test_gpu_branch_installs_the_dispatcher(monkeypatch, tmp_path, caplog):
    """The GPU branch on this CPU machine: a fake device name, a table file for it."""
    monkeypatch.setattr(layers, "_matmul", F.linear)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Test GPU")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(make_table().to_json()))
    with caplog.at_level(logging.INFO, logger="engine.model.layers"):
        text = layers.configure_matmul(fd(double_buffer=False), torch.device("cuda"), torch.float32,
                                       {"qkv_proj": (K, N)}, table_path=str(path))
    assert isinstance(layers._matmul, AdaptiveMatmul) and not layers._matmul.double_buffer
    assert "qkv_proj 200->40: gemv M<=2" in text and "tuned with double_buffer on" in text
    with caplog.at_level(logging.WARNING, logger="engine.model.layers"):
        layers.configure_matmul(fd(), torch.device("cuda"), torch.float32, table_path=str(tmp_path / "none"))
    assert layers._matmul.choose(1, N, K) == CUBLAS and "no matmul table" in caplog.records[-1].getMessage()
    assert caplog.records[-1].levelno == logging.WARNING


def test_linear_layers_call_the_configured_matmul(monkeypatch):
    seen: list[tuple[int, ...]] = []

    def spy(x, weight, bias=None):
        seen.append(tuple(weight.shape))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(layers, "_matmul", spy)
    col = layers.ColumnParallelLinear(8, 6, bias=True)
    row = layers.RowParallelLinear(6, 8, bias=True)
    head = layers.ParallelLMHead(11, 8)
    for module in (col, row, head):
        for p in module.parameters():
            torch.nn.init.normal_(p)
    x = torch.randn(3, 8)
    head.compute_logits(row(col(x)))
    assert seen == [(6, 8), (8, 6), (11, 8)]


def test_linear_shapes_of_a_model():
    from transformers import LlamaConfig

    from engine.model.registry import LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, torch.float32)
    assert layers.linear_shapes(model) == {"qkv_proj": (64, 128), "o_proj": (64, 64), "gate_up_proj": (64, 192),
                                           "down_proj": (96, 64), "lm_head": (64, 300)}


# ----- fdserve tune ----------------------------------------------------------------------------

def test_tune_helpers():
    from engine.tools.tune import candidate_configs, parse_shapes

    assert parse_shapes("qkv=4096x6144, o=4096X4096") == {"qkv": (4096, 6144), "o": (4096, 4096)}
    with pytest.raises(ValueError, match="NAME=KxN"):
        parse_shapes("qkv=4096")
    on = candidate_configs("flat", 4, 4096, 4096, 132, "nvidia", True)
    off = candidate_configs("flat", 4, 4096, 4096, 132, "nvidia", False)
    assert {c.num_stages for c in on} == {3, 4, 6} and {c.split_k for c in on} >= {1, 4}
    assert len(off) < len(on) and all(c.block_m == 16 for c in on)
    gemv_cands = candidate_configs("gemv", 8, 4096, 4096, 132, "nvidia", True)
    assert gemv_cands and all(8 * c.block_n * c.block_k <= 128 * 32 * c.num_warps for c in gemv_cands)
    whole_rows = candidate_configs("gemv", 1, 4096, 4096, 132, "nvidia", True)
    assert {(c.block_n, c.block_k) for c in whole_rows} >= {(1, 4096), (4, 4096), (16, 512)}
    assert {c.num_warps for c in whole_rows} == {4, 8}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_fdserve_tune_without_a_gpu_fails_clearly(capsys):
    from server.cli.main import main

    assert main(["tune", "--shapes", "o=4096x4096"]) == 1
    assert "this machine has none" in capsys.readouterr().err
