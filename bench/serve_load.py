"""A bounded load test of `specpilot serve` on loopback (bench/README "Serving").

For each engine, a real `specpilot serve` process on a free loopback port; first every prompt is
sent alone (the single-request run), then N concurrent clients (the openai client, one thread
each) send the prompts round robin for T seconds, for each N.  Every response's tokens must
equal that prompt's single-request tokens; every request sent must come back (200).  Records
per N: requests, tokens/s, latency p50 / p99, time to first token (streamed), tokens per
verification from the server's /metrics.

    python bench/serve_load.py BUILD --engines compiled,compiled-spec --clients 1,8,32 --seconds 20 -o out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from specpilot.core.files import atomic_write_text
from specpilot.runtime.environment import environment
from specpilot.runtime.prompt_sets import texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`specpilot serve` in its own process, up until closed."""

    def __init__(self, build: str, engine: str, queue: int, extra_env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specpilot.cli", "serve", build, "--port", str(self.port),
                                      "--engine", engine, "--queue-size", str(queue), "--log-level", "warning"],
                                     env={**os.environ, **(extra_env or {})})
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"specpilot serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("specpilot serve did not come up in 600 s")
            time.sleep(0.5)
        with urllib.request.urlopen(f"{self.base}/v1/models") as r:
            self.model = json.loads(r.read())["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.base}/metrics") as r:
            text = r.read().decode()
        out = {}
        for name in ("specpilot_generation_tokens_total", "specpilot_verifications_total"):
            m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
            out[name] = float(m.group(1)) if m else 0.0
        return out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one(api, model: str, prompt: str, max_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, seconds, seconds to the first token) of one streamed completion."""
    start = time.perf_counter()
    first, tokens = None, []
    for chunk in api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=True, extra_body={"return_token_ids": True}):
        ids = chunk.choices[0].model_extra.get("token_ids") or []
        if ids and first is None:
            first = time.perf_counter() - start
        tokens.extend(ids)
    return tokens, time.perf_counter() - start, first or 0.0


def load(server: ServerProcess, prompts: list[str], want: dict[str, list[int]], clients: int, seconds: float,
         max_tokens: int) -> dict:
    from openai import OpenAI
    before = server.metrics()
    results, failures, lock = [], [], threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(index: int):
        api = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=600)
        n = index
        while time.perf_counter() < stop_at:
            prompt = prompts[n % len(prompts)]
            n += clients
            try:
                tokens, took, ttft = one(api, server.model, prompt, max_tokens)
            except Exception as e:      # a lost request is a result to report, not a crash
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append((tokens == want[prompt], len(tokens), took, ttft))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = server.metrics()
    latencies = sorted(r[2] for r in results)
    tokens = sum(r[1] for r in results)
    verifications = after["specpilot_verifications_total"] - before["specpilot_verifications_total"]
    generated = after["specpilot_generation_tokens_total"] - before["specpilot_generation_tokens_total"]
    return {
        "clients": clients, "requests": len(results), "lost": len(failures), "failures": failures[:5],
        "tokens_identical": all(r[0] for r in results) and bool(results),
        "mismatched": sum(not r[0] for r in results),
        "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(results) / wall, 3),
        "latency_p50_s": round(statistics.median(latencies), 4) if latencies else None,
        "latency_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4) if latencies else None,
        "ttft_p50_s": round(statistics.median(r[3] for r in results), 4) if results else None,
        "tokens_per_verification": round(generated / verifications, 3) if verifications else None,
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--engines", default="compiled,compiled-spec")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="mixed", help="a built-in prompt set (code, chat, mixed)")
    ap.add_argument("--requests", type=int, default=8, help="distinct prompts")
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args()
    from openai import OpenAI
    prompts = texts(args.prompts)[:args.requests]
    levels = [int(c) for c in args.clients.split(",")]
    report = {"benchmark": "serve_load", "build": args.build, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "seconds": args.seconds, "environment": environment(), "engines": {}}
    for engine in args.engines.split(","):
        server = ServerProcess(args.build, engine, queue=4 * max(levels))
        try:
            api = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=600)
            want = {p: one(api, server.model, p, args.max_tokens)[0] for p in prompts}   # each alone
            rows = [load(server, prompts, want, n, args.seconds, args.max_tokens) for n in levels]
        finally:
            server.close()
        report["engines"][engine] = rows
        for r in rows:
            print(f"{engine:20s} clients {r['clients']:3d}  {r['tokens_per_s']:9.1f} tok/s  p50 {r['latency_p50_s']} s"
                  f"  p99 {r['latency_p99_s']} s  requests {r['requests']}  lost {r['lost']}  "
                  f"identical {r['tokens_identical']}  tok/verif {r['tokens_per_verification']}", flush=True)
    base = report["engines"].get("compiled")
    for engine, rows in report["engines"].items():
        if base and engine != "compiled":
            for r, b in zip(rows, base):
                r["speedup_vs_compiled"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3) if b["tokens_per_s"] else None
    ok = all(r["tokens_identical"] and not r["lost"] for rows in report["engines"].values() for r in rows)
    report["passed"] = ok
    if args.output:
        atomic_write_text(args.output, json.dumps(report, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
