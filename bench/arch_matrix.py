"""Every card of the device table x every example and bench spec: `specpilot compile --target "cuda
-arch=<arch> -device=<card>"` as a user runs it (no GPU needed), recording per build whether it
built, passed the launch check (the manifest's ``launch``), embeds that arch's code, and the build
time; one JSON in bench/results.  Seeded specs build with --params seeded, checkpoint specs with
--params load (neither writes weights).

    python bench/arch_matrix.py [--devices A100,RTXPRO6000] [--specs examples/tiny-llama.yaml ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from specpilot.compiler.build import seeded_models  # noqa: E402
from specpilot.core.spec import load_spec  # noqa: E402
from specpilot.core.target import DEVICES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def default_specs() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "bench" / "specs").glob("*.yaml"))


def compile_one(spec: Path, card: str, work: Path) -> dict:
    device = DEVICES[card]
    params = "seeded" if seeded_models(load_spec(spec)) else "load"
    out = work / f"{spec.stem}-{card}"
    exe = Path(sys.executable).with_name("specpilot")
    started = time.perf_counter()
    proc = subprocess.run([str(exe), "compile", str(spec), "--target", f"cuda -arch={device.arch} -device={card}",
                           "--params", params, "-o", str(out)], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "SPECPILOT_CUDA_STUB"})
    row = {"spec": str(spec.relative_to(ROOT)), "device": card, "arch": device.arch, "params": params,
           "seconds": round(time.perf_counter() - started, 1), "built": proc.returncode == 0}
    if proc.returncode:
        row["error"] = (proc.stderr.strip().splitlines() or ["(no message)"])[-1][:400]
        return row
    manifest = json.loads((out / "manifest.json").read_text())
    row["launch"] = manifest["launch"]
    row["embeds_arch"] = device.arch.encode() in (out / "model.so").read_bytes()
    subprocess.run(["rm", "-rf", str(out)], check=False)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=",".join(DEVICES), help="cards of the device table (default: all)")
    ap.add_argument("--specs", nargs="*", type=Path, help="spec files (default: examples/ and bench/specs/)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    specs = [p.resolve() for p in args.specs] if args.specs else default_specs()
    cards = args.devices.split(",")
    unknown = [c for c in cards if c not in DEVICES]
    if unknown:
        sys.exit(f"unknown device(s) {unknown}; known: {', '.join(DEVICES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="arch-matrix-") as tmp:
        for spec in specs:
            for card in cards:
                rows.append(compile_one(spec, card, Path(tmp)))
                r = rows[-1]
                status = "ok" if r["built"] and r.get("embeds_arch") else "FAILED"
                detail = (f"most shared {r['launch']['most_shared']['bytes']} B of {r['launch']['shared_limit']}"
                          if r["built"] else r["error"])
                print(f"{r['spec']:45s} {card:11s} {status:6s} {r['seconds']:6.1f} s  {detail}", flush=True)
    path = write("arch-matrix", {"rows": rows, "passed": all(r["built"] and r.get("embeds_arch") for r in rows)},
                 args.out)
    print(f"{sum(r['built'] for r in rows)} / {len(rows)} built; {path}")


if __name__ == "__main__":
    main()
