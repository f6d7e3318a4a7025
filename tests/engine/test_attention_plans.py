"""A backend's decode step through plan + run (`AttentionBackend.plan` once per step: the kernels'
`plan_decode` / `plan_ffd_decode`; each layer's `decode`: `run_decode` / `run_ffd_decode`) equals the
functional kernels layer by layer, bit for bit (on a GPU, or in Triton's interpreter on a CPU), counts what they count,
and plans once per step, not once per layer."""
from __future__ import annotations

import pytest
import torch

import engine.attention.dense as dense_backend
import engine.attention.ffd as ffd_backend
from engine.attention.dense import DensePlan
from engine.attention.ffd import FFDPlan
from engine.attention.metadata import StepShape
from engine.attention.select import make_attention_backend
from engine.config import FlashDecodingConfig
from kernels import decode_attention, new_stats
from kernels.ffd.decode import ffd_decode
from tests.support.attention_metadata import cache_spec, kernel_metadata, planned

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VENDOR = "auto" if DEV.type == "cuda" else "cpu"
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32   # what the GPU kernels are built for
LAYERS = 3
HEADS, KV_HEADS = 4, 2


def paged_layers(lens: tuple[int, ...], *, layers: int, dim: int, page: int, seed: int):
    """q [layers, B, Hq, D], K/V pages [layers, pages, page, Hkv, D] (random), block tables over
    shuffled pages (page 0 unused) and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    num_pages = sum(pages) + 1
    k = torch.randn(layers, num_pages, page, KV_HEADS, dim, generator=gen)
    v = torch.randn(k.shape, generator=gen)
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[start:start + n]
        start += n
    q = torch.randn(layers, len(lens), HEADS, dim, generator=gen)
    q, k, v = (x.to(DEV, DTYPE) for x in (q, k, v))
    return q, k, v, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Patch `module.name` to record the batch size of every call."""
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


DENSE_SETTINGS = [
    {"enable": False},                                        # standard
    {"kernel": "flash"},                                      # flash, the split heuristic
    {"kernel": "flash", "num_splits": 3},                     # flash, forced splits (merge)
    {"async_softmax": True},                                  # fdpp, φ estimated
    {"async_softmax": True, "fixed_max_value": -500.0},       # fdpp, every row flagged and recomputed
]


@pytest.mark.parametrize("settings", DENSE_SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_dense_step_plans_once_and_equals_the_functional_kernels(settings, monkeypatch):
    backend = make_attention_backend(FlashDecodingConfig(**settings), DEV, VENDOR)
    backend.triton = True                    # the GPU path, in the interpreter
    lens = (45, 16, 33)                      # odd lengths; 16 ends exactly on a page boundary
    q, k, v, tables, seq_lens = paged_layers(lens, layers=LAYERS, dim=16, page=16, seed=1)
    backend.allocate(cache_spec(v, HEADS), k, v)
    plans = count_calls(monkeypatch, dense_backend, "plan_decode")
    fdpp = backend.variant == "fdpp"

    counters: dict = {}
    meta = planned(backend, kernel_metadata(tables, seq_lens, counters=counters))
    outs = [backend.decode(i, q[i], k[i], v[i], meta, scale=0.25) for i in range(LAYERS)]
    assert plans == [len(lens)]              # one plan for the step's three layers
    assert isinstance(meta.plan, DensePlan) and meta.plan.decode is not None
    step_rows = int(counters["fdpp_fallback_rows"]) if fdpp else 0

    # the next step (one sequence fewer) plans again, once, and counts from zero at its layer 0
    second: dict = {}
    meta2 = planned(backend, kernel_metadata(tables[:2], seq_lens[:2], counters=second))
    outs2 = [backend.decode(i, q[i, :2], k[i], v[i], meta2, scale=0.25) for i in range(LAYERS)]
    assert plans == [len(lens), 2]
    assert backend.plan(StepShape(len(lens), tables.shape[1], decode_only=False)) == DensePlan()
    assert len(plans) == 2                   # a prefill step plans no decode

    stats = [new_stats(DEV), new_stats(DEV)]
    for i in range(LAYERS):
        for b, out, step_stats in ((len(lens), outs[i], stats[0]), (2, outs2[i], stats[1])):
            extra = {"phi": backend.phi_for(i), "fallback": backend.fallback, "stats": step_stats} if fdpp else {}
            alone = decode_attention(q[i, :b], k[i], v[i], tables[:b], seq_lens[:b], scale=0.25,
                                     variant=backend.variant, num_splits=backend.num_splits or None,
                                     config=backend.configs.decode, **extra)
            assert torch.equal(out, alone), f"layer {i}, {b} sequences"
    if fdpp:
        assert counters["fdpp_rows_checked"] == LAYERS * len(lens) * HEADS
        assert second["fdpp_rows_checked"] == LAYERS * 2 * HEADS
        assert step_rows == int(stats[0][0]) and int(second["fdpp_fallback_rows"]) == int(stats[1][0])
        if settings.get("fixed_max_value") == -500.0:
            assert step_rows == LAYERS * len(lens) * HEADS
    else:
        assert counters == {} and second == {}


def test_dense_plan_is_required_on_the_triton_path():
    backend = make_attention_backend(FlashDecodingConfig(), DEV, VENDOR)
    backend.triton = True
    q, k, v, tables, seq_lens = paged_layers((20,), layers=1, dim=16, page=16, seed=2)
    backend.allocate(cache_spec(v, HEADS), k, v)
    with pytest.raises(RuntimeError, match="plan"):
        backend.decode(0, q[0], k[0], v[0], kernel_metadata(tables, seq_lens), scale=0.25)


def quantized_layers(backend, lens: tuple[int, ...], *, layers: int, seed: int):
    """Random K/V for `lens` written through the backend's torch store (quantize on write)."""
    page = backend.params.block_size
    q, k, v, tables, seq_lens = paged_layers(lens, layers=layers, dim=64, page=page, seed=seed)
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
    backend.allocate(cache_spec(v_cache, HEADS), k_cache, v_cache)
    slots = torch.tensor([int(tables[b, p // page]) * page + p % page for b, n in enumerate(lens) for p in range(n)],
                         device=DEV)
    for i in range(layers):
        flat_k, flat_v = k[i].flatten(0, 1), v[i].flatten(0, 1)   # [pages * page, Hkv, D], row = slot
        backend.store(i, flat_k[slots], flat_v[slots], k_cache[i], v_cache[i], slots)
    return q, k_cache, v_cache, tables, seq_lens


def test_ffd_step_plans_once_and_equals_the_functional_kernel(monkeypatch):
    fd = FlashDecodingConfig(kernel="ffd", ffd_block_size=64, delta=2.0, sink_tokens=4, local_window=64)
    backend = make_attention_backend(fd, DEV, VENDOR)
    backend.compact = False                  # every exact K page kept (the compact pool: test_ffd_compact.py)
    lens = (130, 64, 7)                      # odd lengths; 64 ends exactly on a page boundary
    layers = 2
    q, k, v, tables, seq_lens = quantized_layers(backend, lens, layers=layers, seed=3)
    backend.triton = True                    # the GPU decode, in the interpreter
    plans = count_calls(monkeypatch, ffd_backend, "plan_ffd_decode")
    counters: dict = {}
    meta = planned(backend, kernel_metadata(tables, seq_lens, counters=counters))
    outs = [backend.decode(i, q[i], k[i], v[i], meta, scale=0.125) for i in range(layers)]
    assert plans == [len(lens)]              # one plan for the step's layers
    assert isinstance(meta.plan, FFDPlan)
    totals = [int(counters["ffd_blocks_total"]), int(counters["ffd_blocks_kept"])]
    monkeypatch.undo()

    summed = torch.zeros(2, dtype=torch.int64, device=DEV)
    for i in range(layers):
        pages = backend.pages_of(i)
        stats = torch.zeros(2, dtype=torch.int64, device=DEV)
        alone = ffd_decode(q[i], k[i], v[i], pages.codes, pages.scales, pages.residual, tables, seq_lens,
                           scale=0.125, params=backend.params, num_splits=backend.num_splits or None, stats=stats)
        assert torch.equal(outs[i], alone), f"layer {i}"
        summed += stats
    assert totals == summed.tolist() and totals[0] == layers * KV_HEADS * (2 + 1 + 0)


def test_auto_step_below_the_crossover_runs_the_flash_plan(monkeypatch):
    """"auto" with no row able to reach the crossover: the step's plan is the Flash-Decoding backend's."""
    fd = FlashDecodingConfig(kernel="auto", ffd_block_size=64, ffd_crossover_tokens=4096)
    backend = make_attention_backend(fd, DEV, VENDOR)
    assert backend.dense is not None
    backend.triton = backend.dense.triton = True
    q, k, v, tables, seq_lens = paged_layers((70, 64), layers=2, dim=64, page=64, seed=4)
    backend.allocate(cache_spec(v, HEADS), k, v)
    plans = count_calls(monkeypatch, dense_backend, "plan_decode")
    meta = planned(backend, kernel_metadata(tables, seq_lens))
    outs = [backend.decode(i, q[i], k[i], v[i], meta, scale=0.125) for i in range(2)]
    assert plans == [2] and isinstance(meta.plan, DensePlan)
    for i in range(2):
        alone = decode_attention(q[i], k[i], v[i], tables, seq_lens, scale=0.125, variant="flash",
                                 config=backend.dense.configs.decode)
        assert torch.equal(outs[i], alone)


def test_the_model_runner_plans_every_eager_step_once(tmp_path, monkeypatch):
    """Each forward: the backend's page bookkeeping and its plan once, for the step's shape; a prefill step
    that samples plans its last layer's sampled rows too."""
    from engine import LLM, SamplingParams
    from tests.support.tiny_models import make_tiny_model
    llm = LLM(model=make_tiny_model(tmp_path, "llama"), block_size=16, num_kv_blocks=64, gpu_vendor="cpu")
    runner, backend = llm.engine.runner, llm.engine.backend
    executed: list[int] = []
    prepared: list[int] = []
    shapes: list[StepShape] = []
    for obj, name, record in ((runner, "execute", executed), (backend, "prepare_pages", prepared),
                              (backend, "plan", shapes)):
        original = getattr(obj, name)

        def recorded(arg, *args, _original=original, _record=record, **kwargs):
            _record.append(arg if isinstance(arg, StepShape) else len(arg))
            return _original(arg, *args, **kwargs)
        monkeypatch.setattr(obj, name, recorded)
    llm.generate([list(range(3, 40)), [8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    prefill, rows, *decodes = shapes
    assert len(executed) > 1 and prepared == executed == [shape.num_seqs for shape in (prefill, *decodes)]
    assert not prefill.decode_only and rows == StepShape(num_seqs=2, table_width=3, decode_only=False)
    assert decodes[-1] == StepShape(num_seqs=2, table_width=3, decode_only=True)
