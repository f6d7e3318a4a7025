"""FFD quality on the embedded default model (SmolLM2-135M-Instruct, real weights) on the CPU.

    python bench/ffd_quality.py --contexts 2048 4096 8192 --deltas 3 5 7 --out bench/results

Text: the GnuTLS release notes shipped with the system (/usr/share/doc/libgnutls30/NEWS.gz, English
prose, offline). δ in natural-log units; block 128, sinks 4, local window 128 (config defaults).
Everything runs in float32 with the torch rule of `kernels/ffd/reference.py`, which is what
`kernel = "ffd"` runs on the CPU and what the Triton kernel computes on the GPU.

1. attention analysis: per layer, on the dense model's own q/k/v at `--probes` query positions of
   the last `--window` tokens: block sparsity, recall of the "top" blocks (the fewest full blocks
   holding 95 % of the exact attention mass that falls in full blocks, per query head), dropped
   mass (exact softmax mass of pruned tokens), relative L2 error of the layer's attention output.
2. teacher-forced next token: the text runs through the model once densely and once with the FFD
   rule on every query (the rule is per query, so position p gets exactly what a decode step at
   p computes after the same tokens); on the last `--window` positions: argmax agreement and mean
   KL(dense || FFD) of the next-token distributions.
3. greedy generation (`--generate N`): prompt = the L-token window minus its last N tokens, at
   `--generate-prompts` offsets spread over the text (default: its beginning); the dense engine
   generates N greedy tokens. `--generate-measures free`: FFD generates too, free-running:
   position-wise token agreement and the common-prefix length per prompt. `forced`: FFD
   teacher-forced on dense's tokens: at each of the N steps, the share of steps whose FFD argmax is
   the token dense generated, and mean KL(dense || FFD).
4. passkey (`--passkey`): "The pass key is NNNNN" hidden at 10/50/90 % (`--passkey-depths`: also
   30/70 %) depth of a filler of the same text; dense vs FFD greedy answers, found or not.
5. key format (`--key-formats`): with nothing pruned, at the probe queries, the refined keys'
   relative L2 error and the layer's attention output error for the stored format (residual in
   units of s/R) against an FP8 residual stored unscaled and a bf16 residual.
Writes OUT/ffd_quality.json (`--out-name`) and prints a table last.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention.backend import AttentionBackend  # noqa: E402
from engine.attention.ffd import FFDBackend, params_from_config  # noqa: E402
from engine.attention.kv_cache_spec import KVCacheSpec  # noqa: E402
from engine.attention.layer import Attention, AttentionMetadata, forward_context  # noqa: E402
from engine.attention.select import make_attention_backend  # noqa: E402
from engine.attention.torch_reference import ReferenceBackend  # noqa: E402
from engine.config import FlashDecodingConfig  # noqa: E402
from engine.model.loader import load_model, resolve_model_dir  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402
from kernels.ffd.reference import FP8, attend_seq_ref, dequantize_blocks_ref, quantize_blocks_ref  # noqa: E402

TEXT = Path("/usr/share/doc/libgnutls30/NEWS.gz")
BS = 128
CPU = torch.device("cpu")


def ffd_config(delta: float) -> FlashDecodingConfig:
    return FlashDecodingConfig(kernel="ffd", delta=delta, delta_units="e", ffd_block_size=BS)


class Runner:
    """Prefill one token sequence in chunks over a fresh paged cache with a given backend."""

    def __init__(self, model):
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.q_probe: dict[int, list[torch.Tensor]] = {}

    def run(self, ids: list[int], backend: AttentionBackend, *, logits_from: int, chunk: int = 1024,
            probe_pos: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.layers[0]
        pages = -(-len(ids) // BS)
        kv = torch.zeros(2, len(self.layers), pages, BS, first.num_kv_heads, first.head_dim)
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
        if isinstance(backend, FFDBackend):
            # every exact K page stays: one sequence, prefilled once, no engine to lend pool pages
            backend.compact = False
        backend.allocate(KVCacheSpec(num_layers=len(self.layers), num_heads=first.num_heads,
                                     num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, block_size=BS,
                                     dtype=kv.dtype), kv[0], kv[1])
        if probe_pos is not None:
            self.q_probe = {i: [] for i in range(len(self.layers))}
            backend = QueryProbe(backend, probe_pos, self.q_probe)
        table = torch.arange(pages, dtype=torch.int32)[None]
        logits = []
        with torch.inference_mode():
            for start in range(0, len(ids), chunk):
                end = min(start + chunk, len(ids))
                pos = torch.arange(start, end)
                meta = AttentionMetadata(positions=pos, slot_mapping=pos.clone(),
                                         query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                                         seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                                         max_query_len=end - start, is_decode_only=False)
                with forward_context(meta, backend):
                    hidden = self.model(torch.tensor(ids[start:end]), pos)
                if end > logits_from:
                    logits.append(self.model.compute_logits(hidden[max(0, logits_from - start):]).float())
        return torch.cat(logits), kv


class QueryProbe(AttentionBackend):
    """`inner`, also keeping each layer's prefill q rows at `probe_pos` (for the attention analysis)."""

    def __init__(self, inner: AttentionBackend, probe_pos: list[int], q_probe: dict[int, list[torch.Tensor]]):
        self.inner, self.probe_pos, self.q_probe = inner, probe_pos, q_probe
        self.name, self.variant = inner.name, inner.variant

    def store(self, layer_idx, key, value, k_cache, v_cache, slot_mapping):
        self.inner.store(layer_idx, key, value, k_cache, v_cache, slot_mapping)

    def decode(self, layer_idx, q, k_cache, v_cache, metadata, *, scale):
        return self.inner.decode(layer_idx, q, k_cache, v_cache, metadata, scale=scale)

    def prefill(self, layer_idx, q, k_cache, v_cache, metadata, *, scale):
        end = int(metadata.seq_lens[0])
        start = end - q.shape[0]
        rows = [p - start for p in self.probe_pos if start <= p < end]
        if rows:
            self.q_probe[layer_idx].append(q[rows].clone())
        return self.inner.prefill(layer_idx, q, k_cache, v_cache, metadata, scale=scale)


def token_major(x: torch.Tensor) -> torch.Tensor:
    """[N, Hkv, BS, D] quantization blocks -> [N * BS, Hkv, D] tokens."""
    return x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])


def analyse_layer(q, pos, k, v, scale, deltas, key_formats=False):
    """Selection quality of one layer at the probe queries, per δ (see the module docstring)."""
    length = int(pos.max()) + 1
    nblk = length // BS
    full = k[:nblk * BS].reshape(nblk, BS, *k.shape[1:])
    codes, scales, residual = quantize_blocks_ref(full)
    k2 = token_major(dequantize_blocks_ref(codes, scales))
    khat = token_major(dequantize_blocks_ref(codes, scales, residual))
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    exact_p = []
    for i, p in enumerate(pos.tolist()):               # exact attention of each probe query
        s = torch.einsum("hgd,thd->hgt", q[i].reshape(kv_heads, group, -1), k[:p + 1]) * scale
        exact_p.append(torch.softmax(s, -1))
    rows = {}
    for delta in deltas:
        params = params_from_config(ffd_config(delta))
        out, keep, nq = attend_seq_ref(q, pos, k, v, k2, khat, scale, params)
        stats = dict(kept=0, total=0, dropped=[], recall_hit=0, recall_n=0, rel_err=[])
        for i, p in enumerate(pos.tolist()):
            probs = exact_p[i]                          # [Hkv, G, p+1]
            n = int(nq[i])
            stats["kept"] += int(keep[i, :, :n].sum())
            stats["total"] += n * kv_heads
            block_mass = probs[..., :n * BS].reshape(kv_heads, group, n, BS).sum(-1)   # [Hkv, G, n]
            kept = keep[i, :, :n][:, None, :].expand_as(block_mass)
            stats["dropped"] += (block_mass * ~kept).sum(-1).flatten().tolist()
            order = block_mass.sort(-1, descending=True)
            csum = order.values.cumsum(-1)
            need = csum < 0.95 * csum[..., -1:]        # blocks before reaching 95 % of full-block mass
            need[..., 0] = True
            top = torch.zeros_like(kept).scatter(-1, order.indices, need)
            stats["recall_hit"] += int((top & kept).sum())
            stats["recall_n"] += int(top.sum())
            ref = torch.einsum("hgt,thd->hgd", probs, v[:p + 1]).reshape(-1, v.shape[-1])
            stats["rel_err"].append(float((out[i] - ref).norm() / ref.norm()))
        dropped = torch.tensor(stats["dropped"])
        rows[delta] = dict(sparsity=1 - stats["kept"] / max(1, stats["total"]),
                           recall=stats["recall_hit"] / max(1, stats["recall_n"]),
                           dropped_median=float(dropped.median()), dropped_p90=float(dropped.quantile(0.9)),
                           dropped_max=float(dropped.max()), rel_err_mean=sum(stats["rel_err"]) / len(stats["rel_err"]))
    if key_formats:
        refs = [torch.einsum("hgt,thd->hgd", exact_p[i], v[:p + 1]).reshape(-1, v.shape[-1])
                for i, p in enumerate(pos.tolist())]
        rows["key_formats"] = key_format_errors(q, pos, k, v, scale, refs)
    return rows


def key_format_errors(q, pos, k, v, scale, refs) -> dict:
    """δ = ∞ at the probe queries: refined keys of full blocks, exact tail (see the docstring)."""
    length = int(pos.max()) + 1
    nblk = length // BS
    full = k[:nblk * BS].reshape(nblk, BS, *k.shape[1:])
    codes, scales, residual = quantize_blocks_ref(full)
    exact, two = full.permute(0, 2, 1, 3).float(), dequantize_blocks_ref(codes, scales)
    formats = {"scaled": dequantize_blocks_ref(codes, scales, residual),
               "unscaled": two + (exact - two).to(FP8).float(),
               "bf16": two + (exact - two).bfloat16().float()}
    params = params_from_config(ffd_config(1e9))
    rows = {}
    for name, khat in formats.items():
        out, _, _ = attend_seq_ref(q, pos, k, v, token_major(two), token_major(khat), scale, params)
        errs = [float((out[i] - ref).norm() / ref.norm()) for i, ref in enumerate(refs)]
        rows[name] = {"key_rel_err": float((khat - exact).norm() / exact.norm()),
                      "out_rel_err_mean": sum(errs) / len(errs)}
    return rows


def kl_and_agreement(dense: torch.Tensor, ffd: torch.Tensor) -> tuple[float, float]:
    lp, lq = dense.log_softmax(-1), ffd.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return float(kl.mean()), float((dense.argmax(-1) == ffd.argmax(-1)).float().mean())


def generate(model_dir, prompts: list[list[int]], n, fd: dict) -> list[list[int]]:
    """n greedy tokens after each prompt, all prompts in one engine (continuous batching)."""
    from engine import LLM, SamplingParams
    kv_bytes = max(1 << 30, len(prompts) * (1 << 29))       # ~0.5 GB per 8K-token float32 sequence
    llm = LLM(model=str(model_dir), max_num_batched_tokens=1024, cpu_kv_cache_bytes=kv_bytes, **fd)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


# Free-running controls against the float32 dense engine: the same dense attention with the whole
# model in bf16, the precision most deployments serve in (no pruning, no quantized keys).
CONTROLS = {"dense_bf16": {"kernel": "flash", "dtype": "bfloat16"}}


def generated_agreement(starts: list[int], dense: list[list[int]], other: list[list[int]]) -> dict:
    """Position-wise agreement of two greedy continuations per prompt, and their common prefixes."""
    per_prompt = []
    for start, a_ids, b_ids in zip(starts, dense, other, strict=False):
        same = [a == b for a, b in zip(a_ids, b_ids, strict=False)]
        prefix = next((i for i, s in enumerate(same) if not s), len(same))
        per_prompt.append({"start": start, "agreement": sum(same) / len(same), "common_prefix": prefix})
    return {"agreement": sum(r["agreement"] for r in per_prompt) / len(per_prompt),
            "common_prefix": min(r["common_prefix"] for r in per_prompt), "per_prompt": per_prompt}


def forced_on_generated(runner: Runner, starts: list[int], prompts: list[list[int]], dense_gen: list[list[int]],
                        deltas) -> dict:
    """Greedy agreement over the generated tokens, teacher-forced: prompt + the dense engine's N greedy
    tokens run through the model once densely and once per δ with the FFD rule; at each of the N
    steps, does the next-token argmax equal the token dense generated, and KL(dense || FFD). The
    dense rerun's own argmax is checked against its generation (`dense_matches_generated`: chunked
    prefill and step-by-step decode sum in different orders, so a near-tie may differ)."""
    rows: dict = {"per_prompt": []}
    for start, prompt, gen in zip(starts, prompts, dense_gen, strict=False):
        ids = prompt + gen[:-1]                           # position len(prompt) - 1 + i predicts gen[i]
        target = torch.tensor(gen)
        t0 = time.time()
        dense, _ = runner.run(ids, ReferenceBackend("dense"), logits_from=len(prompt) - 1)
        row: dict[str, Any] = {"start": start, "tokens": len(gen),
                               "dense_matches_generated": float((dense.argmax(-1) == target).float().mean()),
                               "delta": {}}
        for delta in deltas:
            ffd, _ = runner.run(ids, make_attention_backend(ffd_config(delta), CPU, "cpu"), logits_from=len(prompt) - 1)
            kl, agree = kl_and_agreement(dense, ffd)
            row["delta"][f"{delta:g}"] = {"agreement_with_generated": float((ffd.argmax(-1) == target).float().mean()),
                                          "argmax_agreement": agree, "kl_mean": kl}
        row["seconds"] = time.time() - t0
        rows["per_prompt"].append(row)
        print(f"forced on generated, prompt at {start}: dense rerun matches its generation "
              f"{row['dense_matches_generated']:.4f}; " + ", ".join(
                  f"δ={d}: {r['agreement_with_generated']:.4f} (KL {r['kl_mean']:.2e})"
                  for d, r in row["delta"].items())
              + f" ({row['seconds']:.0f} s)", flush=True)
    rows["mean"] = {d: {k: sum(r["delta"][d][k] for r in rows["per_prompt"]) / len(rows["per_prompt"])
                        for k in ("agreement_with_generated", "argmax_agreement", "kl_mean")}
                    for d in rows["per_prompt"][0]["delta"]}
    return rows


def prompt_starts(total: int, length: int, count: int) -> list[int]:
    """Token offsets of `count` prompt windows of `length` tokens, evenly spread over the text (0 first)."""
    span = max(0, total - length)
    return [0] if count <= 1 else [round(i * span / (count - 1)) for i in range(count)]


def passkey(model_dir, tok: Tokenizer, filler: str, length: int, deltas, depths=(0.1, 0.5, 0.9)) -> list[dict]:
    from engine import LLM, SamplingParams
    results = []
    engines = {"dense": LLM(model=str(model_dir), kernel="flash", cpu_kv_cache_bytes=1 << 30)}
    for d in deltas:
        engines[f"ffd_d{d:g}"] = LLM(model=str(model_dir), kernel="ffd", delta=d, ffd_block_size=BS,
                                     cpu_kv_cache_bytes=1 << 30)
    filler_ids = tok.encode(filler)
    keys = {0.1: "71432", 0.3: "58261", 0.5: "40596", 0.7: "93174", 0.9: "28317"}
    for depth in depths:
        key = keys[depth]
        needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
        body = filler_ids[:length - 80]
        cut = int(len(body) * depth)
        text = tok.decode(body[:cut]) + needle + tok.decode(body[cut:])
        msgs = [{"role": "user", "content": text + "\n\nWhat is the pass key? Answer with the number only."}]
        ids = tok.encode(tok.apply_chat_template(msgs))
        row = {"depth": depth, "prompt_tokens": len(ids)}
        for name, llm in engines.items():
            out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=12))[0].text
            row[name] = {"answer": out.strip(), "found": key in re.sub(r"\D", "", out)}
        results.append(row)
        print("passkey", row, flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--deltas", type=float, nargs="+", default=[3.0, 5.0, 7.0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--generate", type=int, default=0, help="free-running tokens (0: skip)")
    ap.add_argument("--generate-contexts", type=int, nargs="*", default=None)
    ap.add_argument("--generate-prompts", type=int, default=1,
                    help="prompt windows spread over the text (1: its beginning only)")
    ap.add_argument("--generate-controls", nargs="*", default=[], choices=sorted(CONTROLS),
                    help="also generate with these engines (no FFD) and compare with float32 dense")
    ap.add_argument("--generate-measures", nargs="+", default=["free"], choices=["free", "forced"],
                    help="free: free-running FFD vs dense; forced: FFD teacher-forced on dense's generated tokens")
    ap.add_argument("--passkey", type=int, nargs="*", default=[], help="context lengths for the passkey test")
    ap.add_argument("--passkey-deltas", type=float, nargs="+", default=[5.0])
    ap.add_argument("--passkey-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                    choices=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--key-formats", action="store_true", help="δ = ∞ error of three residual formats")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--out-name", default="ffd_quality.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    tok = Tokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, torch.float32, CPU)
    runner = Runner(model)
    text = gzip.decompress(TEXT.read_bytes()).decode("utf-8", "replace")
    ids_all = tok.encode(text)
    first = runner.layers[0]
    scale = first.scale
    report: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (embedded GGUF Q4_1, dequantized to float32)",
                              "text": str(TEXT), "block_size": BS, "sink_tokens": 4, "local_window": 128,
                              "delta_units": "e", "date": time.strftime("%Y-%m-%d"), "contexts": {}}
    out_path = args.out / args.out_name
    args.out.mkdir(parents=True, exist_ok=True)
    for length in args.contexts:
        ids = ids_all[:length]
        t0 = time.time()
        probe_pos = [length - 1 - i * (args.window // args.probes) for i in range(args.probes)][::-1]
        dense_logits, kv = runner.run(ids, ReferenceBackend("dense"), logits_from=length - args.window,
                                      probe_pos=probe_pos)
        probes = {i: torch.cat(v) for i, v in runner.q_probe.items()}
        pos = torch.tensor(probe_pos)
        layers = [analyse_layer(probes[i], pos, kv[0, i].reshape(-1, *kv.shape[-2:])[:length],
                                kv[1, i].reshape(-1, *kv.shape[-2:])[:length], scale, args.deltas, args.key_formats)
                  for i in range(len(runner.layers))]
        entry: dict[str, Any] = {"dense_seconds": time.time() - t0, "per_layer": layers, "teacher_forced": {}}
        if args.key_formats:
            for name in layers[0]["key_formats"]:
                errs = [layer["key_formats"][name] for layer in layers]
                print(f"L={length} δ=∞ {name} residual: key rel err "
                      f"{math.sqrt(sum(e['key_rel_err'] ** 2 for e in errs) / len(errs)):.2e} (rms over layers), "
                      f"out rel err {sum(e['out_rel_err_mean'] for e in errs) / len(errs):.2e} (mean), "
                      f"worst layer {max(e['out_rel_err_mean'] for e in errs):.2e}", flush=True)
        for delta in args.deltas:
            t1 = time.time()
            ffd_logits, _ = runner.run(ids, make_attention_backend(ffd_config(delta), CPU, "cpu"),
                                       logits_from=length - args.window)
            kl, agree = kl_and_agreement(dense_logits, ffd_logits)
            entry["teacher_forced"][f"{delta:g}"] = {"kl_mean": kl, "argmax_agreement": agree,
                                                    "seconds": time.time() - t1}
            print(f"L={length} δ={delta:g}: teacher-forced agreement {agree:.4f} KL {kl:.2e} "
                  f"({time.time() - t1:.0f} s)", flush=True)
        if args.generate and (args.generate_contexts is None or length in args.generate_contexts):
            starts = prompt_starts(len(ids_all), length, args.generate_prompts)
            prompts = [ids_all[a:a + length - args.generate] for a in starts]
            dense_gen = generate(model_dir, prompts, args.generate, {"kernel": "flash"})
            entry["generate"] = {}
            if "forced" in args.generate_measures:
                entry["forced_on_generated"] = forced_on_generated(runner, starts, prompts, dense_gen, args.deltas)
            variants = {}                                 # free-running engines, compared with dense_gen
            if "free" in args.generate_measures:
                variants = {f"{d:g}": {"kernel": "ffd", "delta": d, "ffd_block_size": BS} for d in args.deltas}
                variants.update({name: CONTROLS[name] for name in args.generate_controls})
            for name, fd in variants.items():
                gens = generate(model_dir, prompts, args.generate, fd)
                entry["generate"][name] = row = generated_agreement(starts, dense_gen, gens)
                print(f"L={length} {name}: generated agreement {row['agreement']:.3f} (mean of {len(starts)} "
                      f"prompts), per prompt {[round(r['agreement'], 3) for r in row['per_prompt']]}, common "
                      f"prefixes {[r['common_prefix'] for r in row['per_prompt']]}", flush=True)
        report["contexts"][str(length)] = entry
        out_path.write_text(json.dumps(report, indent=1))
    if args.passkey:
        filler = text[len(text) // 3:]
        report["passkey"] = {str(n): passkey(model_dir, tok, filler, n, args.passkey_deltas, args.passkey_depths)
                             for n in args.passkey}
        out_path.write_text(json.dumps(report, indent=1))
    print_table(report, args.deltas)


def summarise(layers, delta):
    rows = [layer[delta] if delta in layer else layer[str(delta)] for layer in layers]   # JSON keys are str
    med = lambda xs: sorted(xs)[len(xs) // 2]   # noqa: E731
    return dict(sparsity=sum(r["sparsity"] for r in rows) / len(rows),
                recall=min(r["recall"] for r in rows), dropped_median=med([r["dropped_median"] for r in rows]),
                dropped_p90_worst=max(r["dropped_p90"] for r in rows),
                rel_err=sum(r["rel_err_mean"] for r in rows) / len(rows))


def print_table(report, deltas) -> None:
    print("\n| L | δ (nat) | mean block sparsity | min layer recall | median dropped mass | worst-layer p90 "
          "dropped | mean out rel err | teacher-forced agreement | mean KL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length, entry in report["contexts"].items():
        for delta in deltas:
            s = summarise(entry["per_layer"], delta)
            tf = entry["teacher_forced"][f"{delta:g}"]
            print(f"| {length} | {delta:g} | {s['sparsity']:.3f} | {s['recall']:.4f} | {s['dropped_median']:.1e} | "
                  f"{s['dropped_p90_worst']:.1e} | {s['rel_err']:.1e} | {tf['argmax_agreement']:.4f} | "
                  f"{tf['kl_mean']:.1e} |")


if __name__ == "__main__":
    main()
