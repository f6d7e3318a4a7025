"""Where a decode step's time goes, on the GPU: host vs graph replay vs each kernel.

    python bench/decode_profile.py --model synthetic:llama-3.1-8b --context-len 1024 --batch 1

For one attention variant, with B requests of the given context decoding together:
1. engine step: wall time of `LLMEngine.step()` per decode step (what a client sees per token);
2. graph replay: the captured decode graph replayed back to back, CUDA-event timed (GPU time only);
   step − replay is the host's share (scheduling, inputs, sampling, detokenizing) that the GPU waits for;
3. kernels: one eager decode step under torch.profiler, GPU time per kernel name, largest first,
   with the number of launches: what to fuse or speed up.
Writes OUT/decode_profile_<variant>_<B>x<L>.json and prints the table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.e2e import VARIANTS, random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def start_decoding(llm: LLM, batch: int, context_len: int, max_tokens: int) -> None:
    engine = llm.engine
    tok = engine.tokenizer
    for i in range(batch):
        prompt = random_prompt(tok.vocab_size, set(tok.eos_token_ids), context_len, f"profile/{i}")
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while any(seq.num_computed_tokens < len(seq) - 1 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):   # a few decode steps: warm
        engine.step()


def time_steps(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_replay(llm: LLM, batch: int, reps: int) -> float | None:
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    bucket = graphs.bucket_for(batch, 1)
    graph = graphs.graphs[bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()   # the static inputs still hold the last step's: same KV slot rewritten, harmless
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_table(llm: LLM) -> list[dict]:
    """GPU time per kernel of one eager decode step (the graph holds the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine.runner
    llm.engine.sync()   # no step in flight: every sequence's last token is real
    seqs = list(llm.engine.scheduler.running)
    for seq in seqs:
        seq.num_scheduled_tokens = 1
    saved, runner.graphs = runner.graphs, None
    try:
        runner.execute(seqs)   # eager warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(seqs)
            torch.cuda.synchronize()
    finally:
        runner.graphs = saved
    totals: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]].append(event.device_time_total if hasattr(event, "device_time_total")
                                           else event.cuda_time_total)
    rows = [{"kernel": k, "launches": len(v), "us": sum(v)} for k, v in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic:llama-3.1-8b")
    p.add_argument("--variant", default="flash", choices=list(VARIANTS))
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    overrides = {k: v for k, _, v in (s.partition("=") for s in args.set)}
    llm = LLM(model=args.model, max_num_seqs=max(args.batch, 8), **VARIANTS[args.variant], **overrides)
    start_decoding(llm, args.batch, args.context_len, args.steps * 2 + 16)
    steps = time_steps(llm, args.steps)
    replay = time_replay(llm, args.batch, 20)
    kernels = kernel_table(llm)
    step_ms = statistics.median(steps)
    result = {"model": args.model, "variant": args.variant, "batch": args.batch, "context_len": args.context_len,
              "device": torch.cuda.get_device_name(), "step_ms": step_ms, "replay_ms": replay,
              "eager_kernel_ms": sum(r["us"] for r in kernels) / 1e3,
              "launches": sum(r["launches"] for r in kernels), "kernels": kernels}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_profile_{args.variant}_{args.batch}x{args.context_len}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{args.variant} B={args.batch} L={args.context_len}: engine step {step_ms:.3f} ms, graph replay "
          f"{replay if replay is None else round(replay, 3)} ms, eager kernels {result['eager_kernel_ms']:.3f} ms "
          f"in {result['launches']} launches")
    print(f"{'us':>9} {'n':>5}  kernel")
    for r in kernels[:25]:
        print(f"{r['us']:9.1f} {r['launches']:5d}  {r['kernel']}")
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
