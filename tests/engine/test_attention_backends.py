"""`[flashdecoding]` -> backend: each switch picks exactly one algorithm; on CPU its torch reference
(`cpu_attention = "reference"`), the fused CPU attention, or the C++ decode kernel (the default where it builds)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from engine.attention.layer import Attention, AttentionMetadata, forward_context
from engine.attention.phi_file import load_phi
from engine.attention.select import make_attention_backend
from engine.config import FlashDecodingConfig
from engine.tools.calibration import calibrate
from kernels import decode_reference
from kernels.attention.reference import decode_attention_ref, prefill_attention_ref
from kernels.native.paged_decode import isa
from kernels.native.paged_prefill import library as prefill_library
from kernels.native.paged_prefill import library_f32 as prefill_library_f32
from tests.support.attention_metadata import cache_spec, kernel_metadata, planned

CPU = torch.device("cpu")


def decode_inputs(seed=0, lens=(300, 45, 129), heads=4, kv_heads=2, dim=16, page=16):
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + page - 1) // page for n in lens]
    k = torch.randn(sum(pages) + 1, page, kv_heads, dim, generator=gen)
    v = torch.randn(k.shape, generator=gen)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 1
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(start, start + n, dtype=torch.int32).flip(0)
        start += n
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def run_decode(backend, inputs, layer_idx=0, counters=None):
    q, k, v, tables, lens = inputs
    return backend.decode(layer_idx, q, k, v, kernel_metadata(tables, lens, counters=counters), scale=0.25)


@pytest.mark.parametrize("settings, title", [
    ({"enable": False}, "standard attention"),
    ({"kernel": "flash"}, "Flash-Decoding split-KV"),
    ({"async_softmax": True}, "FlashDecoding++ async softmax"),
    ({"async_softmax": True, "fixed_max_value": 3.5}, "φ forced to 3.5"),
])
def test_each_setting_names_and_runs_its_algorithm(settings, title):
    backend = make_attention_backend(FlashDecodingConfig(**settings), CPU, "cpu", cpu_attention="reference")
    assert backend.name.startswith("torch reference (cpu): ") and title in backend.name
    assert "prefill: torch reference (cpu)" in backend.name
    inputs = decode_inputs()
    out = run_decode(backend, inputs)
    assert torch.allclose(out, decode_attention_ref(*inputs, scale=0.25), atol=1e-5)


@pytest.mark.parametrize("settings, decode_name", [
    ({"enable": False}, "torch one exact pass (cpu), the softmax of standard attention"),
    ({"kernel": "flash"}, "torch one exact pass (cpu), the softmax of Flash-Decoding"),
    ({"async_softmax": True}, "torch reference (cpu): FlashDecoding++"),     # its arithmetic differs: no fusing
])
def test_fused_cpu_attention_names_what_runs(settings, decode_name):
    backend = make_attention_backend(FlashDecodingConfig(**settings), CPU, "cpu", cpu_attention="fused")
    assert backend.name.startswith(decode_name) and "prefill: torch SDPA (cpu)" in backend.name
    inputs = decode_inputs()
    out = run_decode(backend, inputs)
    assert torch.allclose(out, decode_attention_ref(*inputs, scale=0.25), atol=1e-5)


@pytest.mark.parametrize("settings, title", [({"enable": False}, "standard attention"),
                                             ({"kernel": "flash"}, "Flash-Decoding")])
@pytest.mark.parametrize("cpu_attention", ["auto", "native"])
def test_native_cpu_decode_is_chosen_when_the_cache_is_allocated(settings, title, cpu_attention):
    backend = make_attention_backend(FlashDecodingConfig(**settings), CPU, "cpu", cpu_attention=cpu_attention)
    inputs = decode_inputs()
    q, k, v = inputs[:3]
    backend.allocate(cache_spec(v[None], q.shape[1]), k[None], v[None])
    assert backend.name.startswith(f"C++ paged kernel (cpu, {isa()}), the softmax of {title}")
    assert "prefill: torch SDPA (cpu)" in backend.name
    out = run_decode(backend, inputs)
    expected = decode_attention_ref(*(t.double() if t.is_floating_point() else t for t in inputs), scale=0.25)
    assert (out.double() - expected).norm() / expected.norm() < 1e-5


@pytest.mark.skipif(not prefill_library().paged_prefill_available(), reason="the CPU has no AVX512-BF16")
def test_native_cpu_prefill_runs_on_bf16_pages():
    q, k, v, tables, lens = decode_inputs(dim=64)
    k, v = k.bfloat16(), v.bfloat16()
    starts = torch.tensor([0, 100, 145, 146], dtype=torch.int32)   # chunks after cached prefixes, one decode row
    q = torch.randn(146, q.shape[1], 64).bfloat16()
    backend = make_attention_backend(FlashDecodingConfig(), CPU, "cpu")
    backend.allocate(cache_spec(v[None], q.shape[1]), k[None], v[None])
    assert "prefill: C++ paged kernel (cpu, AVX512-BF16)" in backend.name
    assert backend.fuse_rope_store and "kv store: C++, fused with RoPE (cpu)" in backend.name
    out = backend.prefill(0, q, k, v, kernel_metadata(tables, lens, starts), scale=0.125)
    expected = prefill_attention_ref(q.double(), k.double(), v.double(), tables, lens, starts, scale=0.125)
    assert float((out.double() - expected).norm() / expected.norm()) < 3e-3
    fused = make_attention_backend(FlashDecodingConfig(), CPU, "cpu", cpu_attention="fused")
    fused.allocate(cache_spec(v[None], q.shape[1]), k[None], v[None])
    assert "prefill: torch SDPA (cpu)" in fused.name and not fused.fuse_rope_store


@pytest.mark.skipif(not prefill_library_f32().paged_prefill_f32_available(), reason="neither AVX2 nor AVX-512")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_native_cpu_prefill_runs_on_float32_queries(kv_dtype):
    q, k, v, tables, lens = decode_inputs(dim=64)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    starts = torch.tensor([0, 100, 145, 146], dtype=torch.int32)   # chunks after cached prefixes, one decode row
    q = torch.randn(146, q.shape[1], 64)
    backend = make_attention_backend(FlashDecodingConfig(), CPU, "cpu")
    backend.allocate(cache_spec(v[None], q.shape[1], dtype=torch.float32), k[None], v[None])
    assert backend.cpu_native_prefill and "prefill: C++ paged kernel (cpu, float32, " in backend.name
    out = backend.prefill(0, q, k, v, kernel_metadata(tables, lens, starts), scale=0.125)
    expected = prefill_attention_ref(q.double(), k.double(), v.double(), tables, lens, starts, scale=0.125)
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-6
    fused = make_attention_backend(FlashDecodingConfig(), CPU, "cpu", cpu_attention="fused")
    fused.allocate(cache_spec(v[None], q.shape[1], dtype=torch.float32), k[None], v[None])
    assert "prefill: torch SDPA (cpu)" in fused.name and not fused.cpu_native_prefill


def test_native_cpu_decode_says_what_it_cannot_take():
    inputs = decode_inputs(dim=12)    # not a multiple of the kernel's vector width
    q, k, v = inputs[:3]
    auto = make_attention_backend(FlashDecodingConfig(), CPU, "cpu")
    auto.allocate(cache_spec(v[None], q.shape[1]), k[None], v[None])
    assert auto.name.startswith("torch one exact pass (cpu)")
    assert torch.allclose(run_decode(auto, inputs), decode_attention_ref(*inputs, scale=0.25), atol=1e-5)
    native = make_attention_backend(FlashDecodingConfig(), CPU, "cpu", cpu_attention="native")
    with pytest.raises(ValueError, match="head_dim 12"):
        native.allocate(cache_spec(v[None], q.shape[1]), k[None], v[None])
    with pytest.raises(ValueError, match="async_softmax"):
        make_attention_backend(FlashDecodingConfig(async_softmax=True), CPU, "cpu", cpu_attention="native")


def test_flash_on_cpu_really_splits():
    backend = make_attention_backend(FlashDecodingConfig(num_splits=4), CPU, "cpu", cpu_attention="reference")
    inputs = decode_inputs()
    out = run_decode(backend, inputs)
    expected = decode_reference(*inputs, scale=0.25, variant="flash", num_splits=4)
    assert torch.equal(out, expected) and "splits=4" in backend.name


def test_fdpp_overflow_is_counted_and_fallback_is_exact():
    inputs = decode_inputs()
    exact = decode_attention_ref(*inputs, scale=0.25)
    for fallback in (True, False):
        fd = FlashDecodingConfig(async_softmax=True, fixed_max_value=-500.0, fallback_on_overflow=fallback)
        backend = make_attention_backend(fd, CPU, "cpu")
        counters: dict[str, float] = {}
        out = run_decode(backend, inputs, counters=counters)
        assert counters == {"fdpp_rows_checked": 12.0, "fdpp_fallback_rows": 12.0}
        run_decode(backend, inputs, layer_idx=1, counters=counters)     # counts add up over layers
        assert counters == {"fdpp_rows_checked": 24.0, "fdpp_fallback_rows": 24.0}
        assert torch.allclose(out, exact, atol=1e-5) == fallback


def test_calibrated_phi_per_layer(tmp_path):
    path = tmp_path / "phi.json"
    path.write_text(json.dumps({"version": 1, "phi": [1.0, -400.0]}))
    fd = FlashDecodingConfig(async_softmax=True, fixed_max_value=True, calibration_file=str(path))
    backend = make_attention_backend(fd, CPU, "cpu")
    counters: dict[str, float] = {}
    run_decode(backend, decode_inputs(), layer_idx=0, counters=counters)
    assert counters["fdpp_fallback_rows"] == 0
    run_decode(backend, decode_inputs(), layer_idx=1, counters=counters)   # φ = -400: every row flags
    assert counters["fdpp_fallback_rows"] == 12
    with pytest.raises(ValueError, match="layer 2"):
        run_decode(backend, decode_inputs(), layer_idx=2)


def test_fixed_phi_without_calibration_file_is_a_startup_error():
    fd = FlashDecodingConfig(async_softmax=True, fixed_max_value=True)
    with pytest.raises(ValueError, match="calibration_file"):
        make_attention_backend(fd, CPU, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_vendor_contradicting_hardware_is_an_error():
    with pytest.raises(ValueError, match="contradicts the hardware"):
        make_attention_backend(FlashDecodingConfig(), CPU, "nvidia")


def test_bad_calibration_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 1, "phi": ["x"]}))
    with pytest.raises(ValueError, match="calibration file"):
        load_phi(path)


class TwoLayerAttention(nn.Module):
    """Just the attention layers of a 2-layer model: enough for the calibration plumbing."""

    def __init__(self, heads=4, kv_heads=2, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(Attention(heads, kv_heads, dim, dim ** -0.5, i) for i in range(2))
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x, x[:, :self.kv_heads * self.dim], x[:, -self.kv_heads * self.dim:])
        return x


def test_calibrate_writes_a_loadable_phi_file(tmp_path):
    model = TwoLayerAttention()
    for layer in model.layers:
        layer.k_cache = torch.zeros(8, 16, 2, 16)
        layer.v_cache = torch.zeros(8, 16, 2, 16)

    def run_forward(backend):
        gen = torch.Generator().manual_seed(0)
        prompt = 40   # one prefill chunk of 40 tokens, then one decode step
        tables = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
        steps = [(torch.arange(prompt), prompt, False), (torch.tensor([prompt]), prompt + 1, True)]
        for positions, context, is_decode in steps:
            meta = AttentionMetadata(positions=positions, slot_mapping=positions.clone(),
                                     query_start_loc=torch.tensor([0, len(positions)], dtype=torch.int32),
                                     seq_lens=torch.tensor([context], dtype=torch.int32), block_tables=tables,
                                     max_query_len=len(positions), is_decode_only=is_decode)
            with forward_context(meta, backend):
                model(torch.randn(len(positions), 4 * 16, generator=gen))

    path = tmp_path / "phi.json"
    result = calibrate(model, run_forward, kv_dtype=torch.bfloat16, output_path=path, model_name="tiny")
    assert [layer["rows"] for layer in result["layers"]] == [4 * 41, 4 * 41]
    assert all(layer["fits_window"] and layer["rows_outside_window"] == 0 for layer in result["layers"])
    assert load_phi(path) == result["phi"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_fdpp_counts_on_the_device():
    fd = FlashDecodingConfig(async_softmax=True, fixed_max_value=-500.0)
    backend = make_attention_backend(fd, torch.device("cuda"), "auto")
    assert backend.name.startswith("triton[")
    inputs = [t.cuda() for t in decode_inputs()]
    q, k, v, tables, lens = inputs
    backend.allocate(cache_spec(v[None], num_heads=q.shape[1]), k[None], v[None])
    counters: dict = {}
    out = backend.decode(0, q, k, v, planned(backend, kernel_metadata(tables, lens, counters=counters)), scale=0.25)
    assert int(counters["fdpp_fallback_rows"]) == 12 and counters["fdpp_rows_checked"] == 12
    ref = decode_attention_ref(*inputs, scale=0.25)
    assert float((out - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("kernel", ["ffd", "auto"])
def test_ffd_on_an_amd_gpu_is_refused_at_startup_naming_flash(kernel, monkeypatch):
    """A ROCm build reports its GPU as device type "cuda"; kernel = "ffd" | "auto" with gpu_vendor
    "amd" is refused before any kernel or CUDA query, and the message names kernel = "flash"."""
    import kernels.vendor
    monkeypatch.setattr(kernels.vendor, "detect_vendor", lambda: "amd")
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: pytest.fail("queried the GPU"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: pytest.fail("queried the GPU"))
    fd = FlashDecodingConfig(kernel=kernel, ffd_crossover_tokens=4096 if kernel == "auto" else None)
    with pytest.raises(ValueError, match=f'kernel = "{kernel}".*NVIDIA.*set kernel = "flash"'):
        make_attention_backend(fd, torch.device("cuda"), "amd")
    with pytest.raises(ValueError, match='set kernel = "flash"'):    # the stored crossover is not consulted first
        make_attention_backend(FlashDecodingConfig(kernel=kernel), torch.device("cuda"), "auto")


def test_ffd_crossover_table_ships_beside_the_kernels():
    """The measured "auto" crossover per GPU is data (kernels/ffd/crossover.json), not code."""
    from kernels.ffd.crossover import crossover_table
    assert crossover_table()["NVIDIA H200"] == 16384
