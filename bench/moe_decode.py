"""The decode-sized MoE block's small launches at Qwen3-30B-A3B's shape (128 experts, top-8, hidden
2048, expert intermediate 768, 32 q / 4 kv heads of 128; bf16): the router through the matmul table
against `router_logits` over its configs, top-k routing, the whole block (router, routing, experts)
both ways, and Qwen3's q/k norm as two RMSNorm launches against `qk_rms_norm`.

    python bench/moe_decode.py --out bench/results/moe

Each timing is `fdserve tune`'s: one CUDA graph of many calls, median µs per call over replays, each
call on its own router copy and routed afresh (16 routings cycled) so weights come from HBM.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python bench/moe_decode.py` from anywhere

from engine.tools.tune import GraphTimer  # noqa: E402
from kernels import fused  # noqa: E402
from kernels.gemm.dispatch import AdaptiveMatmul  # noqa: E402
from kernels.moe import RouterConfig, fused_moe, moe_config, route_topk, router_logits  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
ROUTINGS = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/moe"))
    p.add_argument("--tokens", default="1,2,4,8", help="token counts for the router and the whole block")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=gen) * 0.02).to(dt)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=gen) * 0.02).to(dt)
    timer = GraphTimer(reps=10)
    router_copies = timer.copies_for(EXPERTS * HIDDEN * 2)
    routers = [(torch.randn(EXPERTS, HIDDEN, device=dev, generator=gen) * 0.02).to(dt) for _ in range(router_copies)]
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "shape": [EXPERTS, TOP_K, HIDDEN, INTER]}
    lines: list[str] = []
    table_router = AdaptiveMatmul.from_file(torch.cuda.get_device_name(), dt, double_buffer=False)

    def operands(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        xs = [torch.randn(m, HIDDEN, device=dev, generator=gen).to(dt) for _ in range(ROUTINGS)]
        logits = [torch.randn(m, EXPERTS, device=dev, generator=gen).to(dt) for _ in range(ROUTINGS)]
        return xs, logits, [route_topk(lg, TOP_K, True) for lg in logits]

    # Router: the matmul table's choice against router_logits configs.
    router_rows = []
    router_grid = [RouterConfig(be, bk, w) for be, bk, w in product((1, 2, 4, 8), (512, 1024, 2048), (4, 8))]
    for m in [int(t) for t in args.tokens.split(",")]:
        xs, _, _ = operands(m)
        row: dict[str, Any] = {"m": m, "table_us": timer(partial(lambda xs, i: table_router(xs[i % ROUTINGS],
                                                                                     routers[i]), xs), router_copies)}
        best = None
        for rcfg in router_grid if m == 1 else [RouterConfig()]:
            us = timer(partial(lambda xs, rcfg, i: router_logits(xs[i % ROUTINGS], routers[i], rcfg), xs, rcfg),
                       router_copies)
            row.setdefault("configs", []).append({**rcfg.__dict__, "us": us})
            best = min(best or (us, rcfg), (us, rcfg), key=lambda b: b[0])
        assert best is not None
        row["best"] = {**best[1].__dict__, "us": best[0]}
        router_rows.append(row)
        lines.append(f"router M={m}: matmul table {row['table_us']:.2f} us, router_logits {best[0]:.2f} us "
                     f"({best[1]})")
    result["router"] = router_rows

    xs, logits, _ = operands(1)
    result["route_topk_us"] = timer(lambda i: route_topk(logits[i], TOP_K, True), ROUTINGS)
    lines.append(f"route_topk M=1: {result['route_topk_us']:.2f} us")

    # The whole block per M, with the experts' table config: router through the matmul table or
    # `router_logits` (its best config at M = 1), then `route_topk` and `fused_moe`.
    best_router = RouterConfig(**{k: v for k, v in router_rows[0]["best"].items() if k != "us"})

    def block(router: Any, xs: list[torch.Tensor], i: int) -> torch.Tensor:
        x = xs[i % ROUTINGS]
        weights, ids = route_topk(router(x, routers[i]), TOP_K, True)
        return fused_moe(x, w13, w2, weights, ids, moe_config(x.shape[0], EXPERTS, TOP_K, HIDDEN, INTER, dev, dt))

    blocks = []
    for m in [int(t) for t in args.tokens.split(",")]:
        xs, _, _ = operands(m)
        brow: dict[str, Any] = {"m": m, "config": moe_config(m, EXPERTS, TOP_K, HIDDEN, INTER, dev, dt).to_dict()}
        brow["table_router_block_us"] = timer(partial(block, table_router, xs), router_copies)
        brow["block_us"] = timer(partial(block, partial(router_logits, config=best_router), xs), router_copies)
        blocks.append(brow)
        lines.append(f"block M={m}: table router {brow['table_router_block_us']:.2f} us, router_logits "
                     f"{brow['block_us']:.2f} us")
    result["block"] = blocks

    # Qwen3's q/k norm: the two RMSNorm launches against one.
    qkv = torch.randn(1, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, generator=gen).to(dt)
    q, k, _ = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    qw, kw = torch.ones(HEAD_DIM, device=dev, dtype=dt), torch.ones(HEAD_DIM, device=dev, dtype=dt)
    result["qk_norm_two_us"] = timer(lambda i: (fused.rms_norm(q.reshape(1, Q_HEADS, HEAD_DIM), qw, 1e-6),
                                                fused.rms_norm(k.reshape(1, KV_HEADS, HEAD_DIM), kw, 1e-6)), 1)
    result["qk_norm_one_us"] = timer(lambda i: fused.qk_rms_norm(q, k, qw, kw, 1e-6, 1e-6), 1)
    lines.append(f"q/k norm M=1: two launches {result['qk_norm_two_us']:.2f} us, one {result['qk_norm_one_us']:.2f} us")
    (args.out / "moe_decode.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
