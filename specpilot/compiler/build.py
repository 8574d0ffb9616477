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
from contextlib import nullcontext
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpilot.compiler.loader import load_models
from specpilot.compiler.lower import lower_deployment
from specpilot.compiler.weights import dedupe, file_digest, packed_parameters
from specpilot.passes.base import PassContext
from specpilot.compiler.spec import Spec
from specpilot.compiler.target import TargetSpec
from specpilot.errors import SpecPilotError

MANIFEST_VERSION = 3   # 3: verify returns Gated DeltaNet records, commit takes (conv, records, state, path, index)


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("apache-tvm", "apache-tvm-ffi", "torch", "specpilot"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # a package without metadata (editable checkouts) has no version to record
            out[pkg] = None
    return out


def cuda_runtime_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


# driver entry points libtvm_runtime_cuda.so binds when it loads (TVM 0.27, `nm -D --undefined-only`)
_CUDA_DRIVER_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString",
                        "cuLaunchKernelEx", "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload",
                        "cuTensorMapEncodeTiled", "cuInit")


def _driver_symbols() -> list[str]:
    """The cu* symbols this TVM's CUDA runtime needs, read from the library when nm is there."""
    import tvm

    names = set(_CUDA_DRIVER_SYMBOLS)
    for directory in tvm.libinfo.package_lib_paths() if hasattr(tvm.libinfo, "package_lib_paths") else []:
        lib = Path(directory) / "libtvm_runtime_cuda.so"
        if lib.is_file():
            try:
                out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True,
                                     text=True, check=True).stdout
                names |= {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("cu")}
            except (OSError, subprocess.CalledProcessError):
                pass
    return sorted(n for n in names if n.isidentifier())


def cuda_stub_env() -> dict:
    """Environment for a CUDA build on a machine without a driver: a stub libcuda.so.1 whose
    only job is to let TVM's CUDA runtime library load (every entry point answers
    CUDA_ERROR_NO_DEVICE), and nvcc as the compiler, so the build embeds real sm_XX code."""
    symbols = _driver_symbols()
    tag = hashlib.sha256(" ".join(symbols).encode()).hexdigest()[:12]
    stub_dir = Path(tempfile.gettempdir()) / f"specpilot-cuda-stub-{tag}"
    stub = stub_dir / "libcuda.so.1"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        src = stub_dir / "stub.c"
        src.write_text("".join(f"int {name}() {{ return 100; }}\n" for name in symbols))
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


def load_cuda_runtime() -> bool:
    """Load TVM's CUDA runtime library into this process (needed to embed device code)."""
    import tvm
    import tvm_ffi

    try:
        tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime_cuda", "RTLD_GLOBAL",
                                        extra_lib_paths=tvm.libinfo.package_lib_paths())
        return True
    except Exception:  # dlopen failures come back as OSError or RuntimeError depending on the loader
        return False


def ir_hash(mod) -> str:
    """The structural hash of a Relax IRModule (functions, shapes, attributes; not the weights,
    which are parameters): what the memory compares to decide an entry reproduces a system."""
    import tvm_ffi
    return f"{tvm_ffi.structural_hash(mod) & (2**64 - 1):016x}"


def lower_and_apply(spec: Spec, target: TargetSpec, passes: str | None = None, params: str = "file",
                    say=None, instrument=None, after_pass=None):
    """Lower the deployment and run the pipeline (no TVM compile).  Returns
    (module, pass records, context, pipeline, lowered parameter names, models)."""
    from specpilot.passes.legality import require_legal
    from specpilot.passes.pipeline import parse
    from specpilot.passes.runner import run_pipeline

    say = say or (lambda message: None)
    pipeline = parse(spec.passes if passes is None else passes)
    dtype_name = spec.deployment.dtype
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    say("loading weights")
    tgt, drf = load_models(spec, weights=params == "file")
    context = PassContext(target_kind=target.kind, arch=target.arch, architecture=tgt.cfg.architecture,
                          hybrid=tgt.cfg.is_hybrid, dtype=dtype_name, weights_known=params == "file")
    require_legal(pipeline, context)   # before the long steps
    say("lowering to Relax")
    mod, names = lower_deployment(tgt.cfg, drf.cfg if drf else None, dtype_name, spec.deployment.max_seq_len,
                                  target.is_gpu, drafter_own=drf.own if drf else None,
                                  n_rows=spec.deployment.max_batch)
    # seeded builds know their parameters' names, not their values (passes that convert weights
    # plan by name and shape; the engine converts what it redraws, see the manifest's "w12")
    context.params = packed_parameters(names, tgt, drf, dtype) if params == "file" else dict.fromkeys(names)
    if instrument:
        instrument("lower", mod)
    records = []
    if len(pipeline):
        say(f"running passes {pipeline}")
        mod, records = run_pipeline(pipeline, mod, context, after=after_pass)
    return mod, records, context, pipeline, names, (tgt, drf)


def system_hash(spec: Spec, target: TargetSpec, passes: str, params: str = "file") -> str:
    """ir_hash of stock lowered for this spec and target with ``passes`` applied: what a build
    of that pipeline (with the same ``params``) records as its ``ir_hash``."""
    mod, *_ = lower_and_apply(spec, target, passes, params=params)
    return ir_hash(mod)


def seeded_models(spec: Spec) -> bool:
    """Whether every model of the spec is a seeded random one (``params="seeded"`` builds it)."""
    return spec.target.init is not None and spec.drafter.adapter is None and \
        (spec.drafter.kind != "model" or spec.drafter.init is not None)


def serving_schedule(mod, spec: Spec) -> dict:
    """The serving-schedule knobs schedule passes left on the module (draft-length)."""
    attrs = mod.attrs or {}
    length = int(attrs["specpilot.draft_len"]) if "specpilot.draft_len" in attrs else 0
    return {"draft_len": length or spec.drafter.draft_len,
            "draft_dynamic": bool(int(attrs["specpilot.draft_dynamic"])) if "specpilot.draft_dynamic" in attrs else False,
            "draft_min": int(attrs["specpilot.draft_min"]) if "specpilot.draft_min" in attrs else 1}


def build(spec: Spec, target: TargetSpec, out_dir: Path, passes: str = "",
          print_ir_after: str | None = None, dump_ir: Path | None = None, progress=None,
          params: str = "file", schedule: str | None = None) -> dict:
    """Lower, apply the pipeline, compile and export.  Returns the manifest.

    params="seeded" (seeded random models only) writes no weights: the engine regenerates
    them from the seeds, so realistic-shape builds travel as a few megabytes.
    """
    import tvm

    say = progress or (lambda message: None)
    dtype_name = spec.deployment.dtype
    started = time.perf_counter()
    seeds = {"target": spec.target.init.model_dump() if spec.target.init else None,
             "drafter": spec.drafter.init.model_dump() if spec.drafter.kind == "model" and spec.drafter.init else None}
    if params not in ("file", "seeded"):
        raise SpecPilotError(f"params must be 'file' or 'seeded', not {params!r}")
    if params == "seeded" and not seeded_models(spec):
        raise SpecPilotError("params='seeded' needs seeded random models (init: {seed: N}) for target and drafter")
    capacity = spec.deployment.max_seq_len
    stages: list[tuple[str, object]] = []

    def instrument(stage: str, module) -> None:
        stages.append((stage, module))
        if print_ir_after in (stage, "all"):
            print(f"# IR after {stage}\n{module.script(show_meta=False)}", file=sys.stderr)
        if dump_ir is not None:
            dump_ir.mkdir(parents=True, exist_ok=True)
            (dump_ir / f"{len(stages):02d}-{stage}.py").write_text(module.script(show_meta=False))

    mod, records, context, pipeline, names, (tgt, drf) = lower_and_apply(
        spec, target, passes or spec.passes, params, say, instrument, after_pass=instrument)
    full = context.params
    system_ir_hash = ir_hash(mod)
    serving = serving_schedule(mod, spec)
    from specpilot.schedules.relax_pipeline import SCHEDULES, default_schedule, runs_on
    from specpilot.schedules.relax_pipeline import pipeline as relax_pipeline
    schedule = schedule or (str(mod.attrs["specpilot.schedule"]) if mod.attrs and "specpilot.schedule" in mod.attrs
                            else default_schedule(target.kind, target.arch))
    if schedule not in SCHEDULES:
        raise SpecPilotError(f"unknown schedule set {schedule!r}; known: {', '.join(SCHEDULES)}")
    if not runs_on(schedule, target.kind, target.arch):
        raise SpecPilotError(f"schedule set {schedule} needs a cuda target of sm_80 or later, not {target.text()}")
    tvm_target = target.tvm_target()
    if target.is_gpu and not load_cuda_runtime():
        raise SpecPilotError("a CUDA build needs TVM's CUDA runtime library to load (to embed sm_XX code); "
                             "run through `specpilot compile`, which provides a stub driver when none is installed")
    cuda_graph = bool(mod.attrs and "specpilot.cuda_graph" in mod.attrs and target.is_gpu)
    say(f"compiling for {target.text()}" + (" (CUDA graphs)" if cuda_graph else ""))
    # builds without graphs compile exactly as before, under TVM's default pass context
    graphs = tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}) if cuda_graph else nullcontext()
    from specpilot.compiler.fast_frames import quick_stack
    with tvm_target, graphs, quick_stack():    # TVM parses TVMScript (intrinsics) on the way
        mod = relax_pipeline(tvm_target, schedule)(mod)
        instrument("relax-pipeline", mod)
        executable = tvm.compile(mod, target=tvm_target, relax_pipeline=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = tvm.IRModule({gv: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)})
    (out_dir / "kernels.json").write_text(tvm.ir.save_json(kernels))   # the cost model reads FLOPs/bytes here
    say("exporting")
    lib_path = out_dir / "model.so"
    executable.export_library(str(lib_path))
    hashes = {"model.so": file_digest(lib_path)}
    aliases: dict[str, str] = {}   # seeded builds: the engine works them out when it draws the weights
    names = list(full)        # the passes' parameter rewrites ran with them (passes.runner)
    rewrites = {p.manifest_key: p.manifest_entry(context) for p in pipeline if p.manifest_key}
    rewrites = {key: entry for key, entry in rewrites.items() if entry}   # (w12, fused) for the engine
    if params == "file":
        stored, aliases = dedupe(full)
        (out_dir / "params").mkdir(exist_ok=True)
        params_path = out_dir / "params" / "params.safetensors"
        save_file(stored, str(params_path), metadata={"format": "pt"})
        hashes["params/params.safetensors"] = file_digest(params_path)
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
        "pipeline": str(pipeline), "passes": [vars(r) for r in records], "target": target.text(), "target_kind": target.kind, "arch": target.arch,
        "dtype": dtype_name, "capacity": capacity, "max_batch": spec.deployment.max_batch,
        "schedule": schedule, "cuda_graph": cuda_graph, "ir_hash": system_ir_hash, "serving": serving,
        "models": {"target": tgt.cfg.to_dict(), **({"drafter": drf.cfg.to_dict()} if drf else {})},
        "drafter": {"kind": spec.drafter.kind, "draft_len": spec.drafter.draft_len, "top_k": spec.drafter.top_k,
                    "temperature": spec.drafter.temperature,
                    "max_ngram": spec.drafter.max_ngram, "min_ngram": spec.drafter.min_ngram},
        "functions": functions, "params": names, "aliases": aliases, "tokenizer": tokenizer,
        **rewrites,
        "versions": _versions(),
        "params_source": params, "seeds": seeds, "hashes": hashes,
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
