"""Build and export: spec -> Relax IRModule -> pass pipeline -> TVM compile -> a build directory.

    build/model.so          the compiled module (loads with the TVM runtime alone)
    build/params/params.safetensors   the weights, Hugging Face names, each stored once
    build/tokenizer.json    the target's tokenizer, when it has one
    build/manifest.json     spec, pipeline text, target, model configs, function list,
                            parameter order and aliases, versions, content hashes

CUDA builds on a machine without a GPU driver: TVM embeds real sm_XX code only when its CUDA
runtime library loads, which needs a ``libcuda.so.1``; `cuda_stub_env` makes a stub one and
the CLI re-runs itself with it on the library path (FACTS.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpilot.compiler.config import ModelConfig
from specpilot.compiler.loader import LoadedModel, load_models
from specpilot.compiler.lower import lower_deployment
from specpilot.compiler.spec import Spec
from specpilot.compiler.target import TargetSpec
from specpilot.errors import SpecPilotError

MANIFEST_VERSION = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("apache-tvm", "apache-tvm-ffi", "torch", "specpilot"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # a package without metadata (editable checkouts) has no version to record
            out[pkg] = None
    return out


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Exactly the reference model's frequencies (computed by torch, passed as a parameter)."""
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))


def _parameter_values(names: list[str], target: LoadedModel, drafter: LoadedModel | None,
                      dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(unique tensors by stored name, alias map name -> stored name) for the packed order."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_id: dict[int, str] = {}
    models = {"target": target, "drafter": drafter}
    for name in names:
        prefix, _, hf = name.partition(".")
        model = models[prefix]
        if hf == "rope_inv_freq":
            value = rope_inv_freq(model.cfg)
        else:
            value = model.weights[hf].to(dtype)
        source = model.weights.get(hf) if hf != "rope_inv_freq" else None
        ident = id(source) if source is not None else None
        if ident is not None and ident in by_id:           # an early-exit drafter's shared weights
            aliases[name] = by_id[ident]
            continue
        stored[name] = value.contiguous()
        if ident is not None:
            by_id[ident] = name
    return stored, aliases


def cuda_runtime_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def cuda_stub_env() -> dict:
    """Environment for a CUDA build on a machine without a driver: a stub libcuda.so.1 whose
    only job is to let TVM's CUDA runtime library load, and nvcc as the compiler."""
    stub_dir = Path(tempfile.gettempdir()) / "specpilot-cuda-stub"
    stub = stub_dir / "libcuda.so.1"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        src = stub_dir / "stub.c"
        src.write_text("int cuInit(unsigned int flags) { (void)flags; return 100; }\n")  # 100: no device
        try:
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stub), "-Wl,-soname,libcuda.so.1", str(src)],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SpecPilotError(f"cannot build a stub libcuda.so.1 for cross-compiling ({e}); is gcc installed?") from None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{stub_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    env["SPECPILOT_CUDA_STUB"] = "1"
    return env


def build(spec: Spec, target: TargetSpec, out_dir: Path, passes: str = "",
          print_ir_after: str | None = None, dump_ir: Path | None = None, progress=None) -> dict:
    """Lower, apply the pipeline, compile and export.  Returns the manifest."""
    import tvm
    from tvm import relax

    say = progress or (lambda message: None)
    pipeline = passes or spec.passes
    if pipeline.strip():
        # the pass registry arrives with the pass toolkit; until then every pass name is unknown
        raise SpecPilotError(f"unknown pass in pipeline {pipeline!r}: no passes are registered yet")
    dtype_name = spec.deployment.dtype
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    if target.kind == "llvm" and dtype_name != "float32":
        raise SpecPilotError(f"deployment.dtype {dtype_name} is for GPU targets; --target llvm builds float32")
    started = time.perf_counter()
    say("loading weights")
    tgt, drf = load_models(spec)
    capacity = spec.deployment.max_seq_len
    say("lowering to Relax")
    mod, names = lower_deployment(tgt.cfg, drf.cfg if drf else None, dtype_name, capacity, target.is_gpu,
                                  drafter_shares_target=spec.drafter.kind == "early-exit")
    stages: list[tuple[str, object]] = [("lower", mod)]

    def instrument(stage: str, module) -> None:
        if print_ir_after in (stage, "all"):
            print(f"# IR after {stage}\n{module.script(show_meta=False)}", file=sys.stderr)
        if dump_ir is not None:
            dump_ir.mkdir(parents=True, exist_ok=True)
            (dump_ir / f"{len(stages):02d}-{stage}.py").write_text(module.script(show_meta=False))

    instrument("lower", mod)
    tvm_target = target.tvm_target()
    say(f"compiling for {target.text()}")
    with tvm_target:
        mod = relax.get_default_pipeline(tvm_target)(mod)
        stages.append(("relax-pipeline", mod))
        instrument("relax-pipeline", mod)
        executable = tvm.compile(mod, target=tvm_target, relax_pipeline=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    say("exporting")
    lib_path = out_dir / "model.so"
    executable.export_library(str(lib_path))
    stored, aliases = _parameter_values(names, tgt, drf, dtype)
    (out_dir / "params").mkdir(exist_ok=True)
    params_path = out_dir / "params" / "params.safetensors"
    save_file(stored, str(params_path), metadata={"format": "pt"})
    tokenizer = None
    if tgt.tokenizer_path is not None:
        src = tgt.tokenizer_path / "tokenizer.json" if tgt.tokenizer_path.is_dir() else tgt.tokenizer_path
        shutil.copyfile(src, out_dir / "tokenizer.json")
        tokenizer = "tokenizer.json"
    functions = sorted(gv.name_hint for gv in mod.get_global_vars()
                       if gv.name_hint.startswith(("target_", "drafter_")))
    manifest = {
        "format": "specpilot-build", "version": MANIFEST_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "spec": spec.model_dump(mode="json", exclude={"path"}),
        "spec_path": str(spec.path) if spec.path else None,
        "pipeline": pipeline, "target": target.text(), "target_kind": target.kind, "arch": target.arch,
        "dtype": dtype_name, "capacity": capacity,
        "models": {"target": tgt.cfg.to_dict(), **({"drafter": drf.cfg.to_dict()} if drf else {})},
        "drafter": {"kind": spec.drafter.kind, "draft_len": spec.drafter.draft_len, "top_k": spec.drafter.top_k,
                    "max_ngram": spec.drafter.max_ngram, "min_ngram": spec.drafter.min_ngram},
        "functions": functions, "params": names, "aliases": aliases, "tokenizer": tokenizer,
        "versions": _versions(),
        "hashes": {"model.so": _sha256(lib_path), "params/params.safetensors": _sha256(params_path)},
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
