"""Autoregressive decode speed, side by side in one run: the compiled module vs the PyTorch
reference eager vs the reference under torch.compile vs the reference with its linear weights
in the W12 layout (Triton kernel), at batch 1, plus achieved weight bytes/s against the copy
bandwidth measured in the same run; then the compiled module at larger batches (one step
function call for B sequences, tokens/s summed over the batch).

    python bench/decode.py BUILD_DIR [BUILD_DIR ...] [--context 512] [--steps 48] [--batches 4,8] [--out DIR]

Every engine decodes greedily from the same prompt; the tokens of each are compared with the
eager reference's (in bf16 near-ties may legitimately flip; the match count is reported).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from specpilot.runtime.systems import from_build  # noqa: E402


def copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    n = int(gib * (1 << 30))
    x, y = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * n * iters / (start.elapsed_time(end) / 1e3)


def weight_bytes_per_step(model) -> int:
    """What one decode step must read: every weight once, but only one row of the embedding."""
    total = 0
    for name, t in model.w.items():
        if name == "model.embed_tokens.weight" and not model.cfg.tie_word_embeddings:
            total += t.shape[1] * t.element_size()
        elif name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue  # the same tensor as the embedding, counted there in full
        else:
            total += t.numel() * t.element_size()
    return total


def decode_steps(model, prompt: list[int], steps: int, capacity: int, warmup: int = 3):
    state = model.new_state(capacity)
    logits = model.forward(prompt, state)
    tokens, times = [], []
    for i in range(steps + warmup):
        token = int(logits[-1].argmax())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.forward([token], state)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        tokens.append(token)
    return tokens, times


def device_loop_steps(model, prompt: list[int], steps: int, capacity: int, rounds: int = 7):
    """The engine's unforced greedy loop with the token kept on the device (`decoding.tops_on_device`,
    what `decoding.autoregressive` runs on a compiled model: each step's choice taken there and fed
    to the next step, no host wait a step, `decoding.top2`: the choice, its margin and the
    runner-up), timed over ``steps`` steps after the prefill, one device sync at the end:
    (tokens, seconds per step per round).  top2's choice is the argmax (ties to the lowest index),
    as `decode_steps` takes it: the tokens must be the host loop's."""
    from specpilot.runtime.decoding import top2, tops_on_device
    samples, tokens = [], []
    for _ in range(rounds):
        state = model.new_state(capacity)
        first = top2(model.forward(prompt, state)[-1])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tops = tops_on_device(model, state, first, steps + 1)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / steps)
        tokens = torch.stack([t[1] for t in tops]).tolist()
        state.close()
    return tokens, samples


def step_function_ms(model, prompt: list[int], capacity: int, iters: int = 32, rounds: int = 7) -> list[float]:
    """The compiled batch-1 decode step function alone, called back to back on the same inputs
    (`CompiledModel.step_call`: it recomputes the same step): ms per call, CUDA events around
    ``iters`` calls, ``rounds`` samples -- the step without the engine's per-step host work (its
    inputs copied in, its logits copied out), what a server driving the module directly pays."""
    state = model.new_state(capacity)
    model.forward(prompt, state)
    fn, args, _, _ = model.step_call([([0], state)])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    state.close()
    return samples


def kernel_trace(model, prompt: list[int], capacity: int, iters: int = 16) -> dict:
    """The step function's kernels as the GPU ran them (CUPTI through torch.profiler: no sync
    between kernels, unlike `kernel_profile`): per kernel its GPU time per step, and the step's
    span against the sum of its kernels -- the difference is the GPU idle between launches."""
    import json as _json
    import tempfile
    state = model.new_state(capacity)
    model.forward(prompt, state)
    fn, args, _, _ = model.step_call([([0], state)])
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*args)
        torch.cuda.synchronize()
    state.close()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = _json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return {"error": "no kernel events (CUPTI unavailable?)"}
    per, n = {}, len(kernels)
    for e in kernels:
        row = per.setdefault(e["name"], [0, 0.0])
        row[0] += 1
        row[1] += e["dur"]
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy = sum(e["dur"] for e in kernels)
    rows = sorted(({"kernel": k, "calls_per_step": c / iters, "us_per_step": t / iters} for k, (c, t) in per.items()),
                  key=lambda r: -r["us_per_step"])
    out = {"iters": iters, "kernels_per_step": n / iters, "span_us_per_step": span / iters,
           "busy_us_per_step": busy / iters, "kernels": rows}
    print(f"  GPU trace: {n / iters:.0f} kernels a step, {busy / iters:.0f} us busy of a {span / iters:.0f} us span")
    for r in rows[:24]:
        print(f"    {r['kernel'][:56]:56s} x{r['calls_per_step']:4.1f} {r['us_per_step']:8.1f} us")
    return out


def batched_decode_steps(model, prompts: list[list[int]], steps: int, capacity: int, warmup: int = 3):
    """B sequences decoding together (`CompiledModel.forward_batch`): per-step seconds, and each
    sequence's tokens."""
    states = [model.new_state(capacity) for _ in prompts]
    rows = model.forward_batch(list(zip(prompts, states)))
    tokens, times = [[] for _ in prompts], []
    for i in range(steps + warmup):
        nxt = [int(r[-1].argmax()) for r in rows]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rows = model.forward_batch([([t], st) for t, st in zip(nxt, states)])
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        for seq, t in zip(tokens, nxt):
            seq.append(t)
    for st in states:
        st.close()
    return tokens, times


def kernel_profile(model, prompt: list[int], steps: int, capacity: int, top: int = 14) -> list[dict]:
    """The compiled module's decode step per kernel (TVM's VM instrument, a device sync around
    each kernel): time per step and the bytes its arguments span, heaviest first."""
    from specpilot.runtime.profile import AnyKernel, profiling
    state = model.new_state(capacity)
    logits = model.forward(prompt, state)
    with profiling(model.module, AnyKernel()) as prof:
        for _ in range(steps):
            logits = model.forward([int(logits[-1].argmax())], state)
    state.close()
    rows = []
    for name, calls in prof.by_kernel().items():
        seconds = sum(c.seconds for c in calls) / steps
        nbytes = sum(c.arg_bytes for c in calls) / steps
        rows.append({"kernel": name, "calls_per_step": len(calls) / steps, "us_per_step": seconds * 1e6,
                     "arg_bytes_per_step": nbytes, "arg_bytes_per_s": nbytes / seconds if seconds else 0.0})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"  per-kernel (instrumented; {total / 1e3:.2f} ms of kernels per step, {len(rows)} kernels):")
    for r in rows[:top]:
        print(f"    {r['kernel'][:48]:48s} x{r['calls_per_step']:4.1f} {r['us_per_step']:8.1f} us "
              f"{r['arg_bytes_per_s'] / 1e12:5.2f} TB/s (args)")
    return rows


def w12_weight_bytes(model) -> int:
    from specpilot.runtime.reference.w12_triton import W12Matrix
    return sum(t.nbytes if isinstance(t, W12Matrix) else 0 for t in model.w.values()) + \
        weight_bytes_per_step(_Dense(model))


class _Dense:
    """The model's tensors other than W12 matrices, for `weight_bytes_per_step`."""

    def __init__(self, model):
        from specpilot.runtime.reference.w12_triton import W12Matrix
        self.cfg = model.cfg
        self.w = {k: v for k, v in model.w.items() if not isinstance(v, W12Matrix)}


class Compiled:
    """The reference's forward under torch.compile (dynamic shapes: the cache grows each step)."""

    def __init__(self, model):
        self.model, self.cfg, self.w = model, model.cfg, model.w
        self._forward = torch.compile(model.forward, dynamic=True)

    def new_state(self, capacity):
        return self.model.new_state(capacity)

    def forward(self, tokens, state, **kw):
        # a tensor, not a list: dynamo would specialize on the token values and recompile every step
        return self._forward(torch.as_tensor(tokens, device="cuda"), state, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+", type=Path)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",") if x], default=[4, 8],
                    help="batch sizes for the compiled module after batch 1 (up to the build's max_batch)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also time the compiled module's batch-1 step kernel by kernel over STEPS steps")
    ap.add_argument("--trace", type=int, default=0, metavar="ITERS",
                    help="also trace the step function's kernels on the GPU (CUPTI) over ITERS calls")
    ap.add_argument("--no-w12", action="store_true", help="skip the eager W12 (Triton) engine")
    ap.add_argument("--compiled-only", action="store_true",
                    help="only the compiled module (e.g. a second build of a model already compared)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    profiles, traces = {}, {}
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for build in args.builds:
        t = time.perf_counter()
        system = from_build(build)
        print(f"{build.name}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
        eager = system.engines["stock"].model
        nbytes = weight_bytes_per_step(eager)
        capacity = system.capacity
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, system.vocab_size, (args.context,), generator=gen).tolist()
        engines = {"compiled (TVM)": system.engines["compiled"].model}
        if not args.compiled_only:
            engines["torch eager"] = eager
        if not args.no_torch_compile and not args.compiled_only:
            engines["torch.compile"] = Compiled(eager)
        if not args.no_w12 and not args.compiled_only:
            t = time.perf_counter()
            from specpilot.runtime.reference.model import ReferenceModel
            engines["torch eager, W12 (Triton)"] = ReferenceModel(
                eager.cfg, {k: v for k, v in eager.w.items()
                            if not (eager.cfg.tie_word_embeddings and k == "lm_head.weight")},
                eager.dtype, "cuda", weight_format="w12")
            print(f"  W12 planes built in {time.perf_counter() - t:.1f} s", flush=True)
        reference_tokens = compiled_tokens = None
        for name, model in engines.items():
            try:
                tokens, times = decode_steps(model, prompt, args.steps, capacity)
            except Exception as e:  # torch.compile failures are a result to report, not a crash
                rows.append({"build": build.name, "engine": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"  {name}: failed ({type(e).__name__})", flush=True)
                continue
            if name == "torch eager":
                reference_tokens = tokens
            if name == "compiled (TVM)":
                compiled_tokens = tokens     # kept: builds of one model with other schedules compare on these
            med = statistics.median(times)
            q = statistics.quantiles(times, n=10)
            moved = w12_weight_bytes(model) if "W12" in name else nbytes
            rows.append({"build": build.name, "engine": name, "batch": 1, "median_ms": med * 1e3,
                         "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3, "tokens_per_s": 1 / med, "weight_bytes": moved,
                         "bytes_per_s": moved / med, "fraction_of_copy_bw": moved / med / bandwidth,
                         "tokens": tokens})
        engines.pop("torch eager, W12 (Triton)", None)
        compiled = system.engines["compiled"].model
        if hasattr(compiled, "step_on_device"):
            tokens, times = device_loop_steps(compiled, prompt, args.steps, capacity)
            med, q = statistics.median(times), statistics.quantiles(times, n=10)
            rows.append({"build": build.name, "engine": "compiled, tokens on device", "batch": 1,
                         "median_ms": med * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3, "tokens_per_s": 1 / med,
                         "weight_bytes": nbytes, "bytes_per_s": nbytes / med, "fraction_of_copy_bw": nbytes / med / bandwidth,
                         "same_tokens_as_host_loop": compiled_tokens is not None and
                         tokens[:len(compiled_tokens)] == compiled_tokens[:len(tokens)], "device_loop_tokens": tokens})
        samples = step_function_ms(compiled, prompt, capacity)
        med, q = statistics.median(samples) / 1e3, statistics.quantiles(samples, n=10)
        rows.append({"build": build.name, "engine": "compiled step function", "batch": 1, "median_ms": med * 1e3,
                     "p10_ms": q[0], "p90_ms": q[-1], "tokens_per_s": 1 / med, "weight_bytes": nbytes,
                     "bytes_per_s": nbytes / med, "fraction_of_copy_bw": nbytes / med / bandwidth})
        print(f"  cuda graphs: {compiled.module.manifest.cuda_graph}", flush=True)
        if args.trace:
            try:
                traces[build.name] = kernel_trace(compiled, prompt, capacity, args.trace)
            except Exception as e:  # the profiler is a diagnostic: its failure is reported, not fatal
                traces[build.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"  trace failed: {traces[build.name]['error']}", flush=True)
        if args.profile:
            profiles[build.name] = kernel_profile(compiled, prompt, args.profile, capacity)
        for b in [x for x in args.batches if x <= compiled.max_batch]:
            prompts = [torch.randint(0, system.vocab_size, (args.context,), generator=gen).tolist()
                       for _ in range(b - 1)] + [prompt]
            tokens, times = batched_decode_steps(compiled, prompts, args.steps, capacity)
            med = statistics.median(times)
            q = statistics.quantiles(times, n=10)
            rows.append({"build": build.name, "engine": "compiled (TVM)", "batch": b, "median_ms": med * 1e3,
                         "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3, "tokens_per_s": b / med,
                         "weight_bytes": nbytes, "bytes_per_s": nbytes / med,
                         "fraction_of_copy_bw": nbytes / med / bandwidth, "tokens": tokens[-1]})
        for row in rows:
            if row["build"] == build.name and "tokens" in row and reference_tokens is not None:
                row["tokens_matching_eager"] = sum(a == b for a, b in zip(row.pop("tokens"), reference_tokens))
            if row["build"] == build.name and row.get("engine") == "compiled (TVM)" and row.get("batch") == 1:
                row["tokens"] = compiled_tokens
        del system, engines, eager
        torch.cuda.empty_cache()
    path = write("decode", {"context": args.context, "steps": args.steps, "copy_bandwidth": bandwidth,
                            "results": rows, "kernel_profiles": profiles,
                            "kernel_traces": traces}, args.out)
    print(f"\n{'build':16s} {'engine':26s} {'B':>2s} {'ms/step':>8s} {'p10-p90':>15s} {'tok/s':>7s} {'TB/s':>6s} "
          f"{'%copy':>6s} match")
    for r in rows:
        if "error" in r:
            print(f"{r['build']:16s} {r['engine']:26s} error: {r['error'][:60]}")
            continue
        print(f"{r['build']:16s} {r['engine']:26s} {r.get('batch', 1):2d} {r['median_ms']:8.2f} "
              f"{r['p10_ms']:7.2f}-{r['p90_ms']:<7.2f} "
              f"{r['tokens_per_s']:7.1f} {r['bytes_per_s'] / 1e12:6.2f} {100 * r['fraction_of_copy_bw']:5.1f}% "
              f"{r.get('tokens_matching_eager', '-')}/{args.steps + 3}"
              + (f" same tokens as the host loop: {r['same_tokens_as_host_loop']}" if "same_tokens_as_host_loop" in r else ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
