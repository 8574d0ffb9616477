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
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpilot.core.config import cache_shapes
from specpilot.core.loader import conditioned_drafter, load_models, weights_reference
from specpilot.core.feature_drafter import packing_view
from specpilot.core.manifest import Manifest, write_manifest
from specpilot.compiler.lower import lower_deployment
from specpilot.core.weights import dedupe, file_digest, packed_parameters, params_digest
from specpilot.passes.base import PassContext
from specpilot.core.spec import Spec, conditioned_source, replay_plan
from specpilot.compiler.launch_check import launch_check
from specpilot.core.target import STATIC_SHARED, TargetSpec, compile_arch
from specpilot.core.errors import SpecError, SpecPilotError
from specpilot.core.files import swap_in_dir

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


def _private_dir(name: str) -> Path:
    """A directory under the temp directory that only this user can write: ``name`` when this user
    made it (mode 0700, not a link), else a fresh one -- a library another user planted in a
    predictable folder must never be loaded."""
    path = Path(tempfile.gettempdir()) / name
    try:
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return path
    return Path(tempfile.mkdtemp(prefix="specpilot-cuda-stub-"))


def cuda_stub_env() -> dict:
    """Environment for a CUDA build on a machine without a driver: a stub libcuda.so.1 whose
    only job is to let TVM's CUDA runtime library load (every entry point answers
    CUDA_ERROR_NO_DEVICE), and nvcc as the compiler, so the build embeds real sm_XX code."""
    symbols = _driver_symbols()
    tag = hashlib.sha256(" ".join(symbols).encode()).hexdigest()[:12]
    stub_dir = _private_dir(f"specpilot-cuda-stub-{os.getuid()}-{tag}")
    stub = stub_dir / "libcuda.so.1"
    if not stub.exists():
        src = stub_dir / "stub.c"
        src.write_text("".join(f"int {name}() {{ return 100; }}\n" for name in symbols))
        part = stub_dir / f"libcuda.so.1.{os.getpid()}.part"
        try:
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(part), "-Wl,-soname,libcuda.so.1", str(src)],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SpecPilotError(f"cannot build a stub libcuda.so.1 for cross-compiling ({e}); is gcc installed?") from None
        os.replace(part, stub)
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


@dataclass
class BuildRequest:
    """What to build: a spec for a target into ``out_dir``, with ``passes`` (empty: the spec's own).

    params="seeded" (seeded random models only) writes no weights: the engine regenerates them from
    the seeds, so realistic-shape builds travel as a few megabytes.  params="load" writes none either:
    the manifest references the target's checkpoint (path and digest) and the digest of the parameters
    built from it, and the engine reads and converts the weights at load (`core.loader.load_referenced`)."""
    spec: Spec
    target: TargetSpec
    out_dir: Path
    passes: str = ""
    params: str = "file"
    schedule: str | None = None          # a schedule set instead of the pipeline's / the target's default
    print_ir_after: str | None = None    # a stage name, or "all"
    dump_ir: Path | None = None


@dataclass
class Lowered:
    """The deployment lowered to Relax with the pipeline applied (no TVM compile yet)."""
    mod: object
    records: list
    context: PassContext
    pipeline: object
    names: list[str]
    target_model: object
    drafter_model: object | None
    feature_drafter: tuple | None = None    # a block / feature drafter's (DraftNetConfig, tensors)


def tvm_target(target: TargetSpec):
    """TVM's Target for ``target`` (the dict form: TVM 0.27 no longer parses ``cuda -arch=sm_XX``), with
    the card's limits from the device table.  TVM's ``max_shared_memory_per_block`` bounds the static
    shared memory dlight's rules allocate: 48 KiB on every arch (the opt-in dynamic budget is
    SpecPilot's own kernels' business: `launch_check`)."""
    import tvm

    if target.kind == "llvm":
        level = {} if target.cpu in (None, "generic") else {"mcpu": target.cpu}
        return tvm.target.Target({"kind": "llvm", **level})
    cards = target.launch_devices()
    return tvm.target.Target({"kind": "cuda", "arch": compile_arch(target.arch),
                              "max_shared_memory_per_block": STATIC_SHARED,
                              "max_threads_per_block": min(d.threads_per_block for d in cards),
                              "registers_per_block": min(d.registers_per_sm for d in cards),
                              "l2_cache_size_bytes": target.schedule_device().l2_bytes},
                             host={"kind": "llvm"})


def lower_and_apply(spec: Spec, target: TargetSpec, passes: str | None = None, params: str = "file",
                    say=None, instrument=None, after_pass=None) -> Lowered:
    """Lower the deployment and run the pipeline (no TVM compile)."""
    from specpilot.passes.legality import require_legal
    from specpilot.passes.pipeline import parse
    from specpilot.passes.runner import run_pipeline
    from specpilot.passes.tree_verify import fixed_tokens, packed_verify

    say = say or (lambda message: None)
    text = spec.passes if passes is None else passes
    try:
        pipeline = parse(text)
    except SpecPilotError as e:
        if text == spec.passes:     # the spec's own pipeline: the error names the spec's field
            raise SpecError(spec.path, "passes", str(e)) from None
        raise
    dtype_name = spec.deployment.dtype
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    say("loading weights")
    tgt, drf = load_models(spec, weights=params != "seeded")
    net = conditioned_drafter(spec, tgt, weights=params != "seeded") if conditioned_source(spec.drafter) else None
    device = target.schedule_device()
    context = PassContext(target_kind=target.kind, arch=target.arch, device=device.name if device else None,
                          architecture=tgt.cfg.architecture,
                          hybrid=tgt.cfg.is_hybrid, dtype=dtype_name, max_batch=spec.deployment.max_batch,
                          weights_known=params != "seeded")
    require_legal(pipeline, context)   # before the long steps
    say("lowering to Relax")
    mod, names = lower_deployment(tgt.cfg, drf.cfg if drf else None, dtype_name, spec.deployment.max_seq_len,
                                  target.is_gpu, drafter_own=drf.own if drf else None,
                                  n_rows=spec.deployment.max_batch,
                                  draft=net[0] if net else None, verify_tokens=fixed_tokens(pipeline),
                                  draft_ranks=spec.drafter.top_k, packed_verify=packed_verify(pipeline))
    # seeded builds know their parameters' names, not their values (passes that convert weights
    # plan by name and shape; the engine converts what it redraws, see the manifest's "w12")
    draft = drf or (packing_view(*net, tgt.weights) if net and params != "seeded" else None)
    context.params = packed_parameters(names, tgt, draft, dtype) if params != "seeded" else dict.fromkeys(names)
    if instrument:
        instrument("lower", mod)
    records = []
    if len(pipeline):
        say(f"running passes {pipeline}")
        mod, records = run_pipeline(pipeline, mod, context, after=after_pass)
    return Lowered(mod, records, context, pipeline, names, tgt, drf, net)


def system_hash(spec: Spec, target: TargetSpec, passes: str, params: str = "file") -> str:
    """`system_identity` of stock lowered for this spec and target with ``passes`` applied: what a
    build of that pipeline (with the same ``params``) records as its ``ir_hash``."""
    return system_identity(lower_and_apply(spec, target, passes, params=params))


def system_identity(lowered: "Lowered") -> str:
    """The IRModule's structural hash together with the passes' runtime-visible effects (`pass_effects`):
    two tree budgets lower to the same IR but are different systems."""
    effects = json.dumps(pass_effects(lowered), sort_keys=True, default=str)
    return hashlib.sha256(f"{ir_hash(lowered.mod)}|{effects}".encode()).hexdigest()[:16]


def drafter_init(d):
    """The seeded init of a spec's own drafter network (model or replay kinds), or None."""
    return d.init if d.kind == "model" else d.cost.init if d.kind == "replay" else None


def seeded_models(spec: Spec) -> bool:
    """Whether every model of the spec is a seeded random one (``params="seeded"`` builds it)."""
    d = spec.drafter
    return spec.target.init is not None and d.adapter is None and \
        (d.kind != "model" or d.init is not None) and (d.kind != "replay" or d.cost.init is not None)


def pass_effects(lowered: Lowered) -> dict:
    """Each pass's effect as the runtime must know it, by manifest key (`Pass.manifest_entry`)."""
    entries = {p.manifest_key: p.manifest_entry(lowered.context) for p in lowered.pipeline if p.manifest_key}
    return {key: entry for key, entry in entries.items() if entry is not None}


def _schedule(request: BuildRequest, effects: dict) -> tuple[str, bool]:
    """The schedule set the build compiles with, and whether it captures CUDA graphs."""
    from specpilot.core.schedule_sets import SCHEDULES, default_schedule, runs_on

    target = request.target
    chosen = effects.get("kernel_schedule", {})
    schedule = request.schedule or chosen.get("schedule") or default_schedule(target.kind, target.arch)
    if schedule not in SCHEDULES:
        raise SpecPilotError(f"unknown schedule set {schedule!r}; known: {', '.join(SCHEDULES)}")
    if not runs_on(schedule, target.kind, target.arch):
        raise SpecPilotError(f"schedule set {schedule} needs a cuda target of sm_80 or later, not {target.text()}")
    return schedule, bool(chosen.get("cuda_graph")) and target.is_gpu


def _compile(lowered: Lowered, request: BuildRequest, schedule: str, cuda_graph: bool, bounds: dict, say,
             instrument):
    """Relax-to-TIR pipeline (the step functions' memory planned at ``bounds``, their outputs' storage
    rounded: `compiler.memory_bounds`; neither for a CUDA-graph build) and `tvm.compile`; returns
    (executable, the module it compiled, the launch check's summary: None on the CPU)."""
    import tvm

    from specpilot.compiler.memory_bounds import bound_functions, round_output_storage, round_rows
    from specpilot.kernels.fast_frames import quick_stack
    from specpilot.schedules.relax_pipeline import pipeline as relax_pipeline

    target = request.target
    compile_target = tvm_target(target)
    if target.is_gpu and not load_cuda_runtime():
        raise SpecPilotError("a CUDA build needs TVM's CUDA runtime library to load (to embed sm_XX code); "
                             "run through `specpilot compile`, which provides a stub driver when none is installed")
    say(f"compiling for {target.text()}" + (" (CUDA graphs)" if cuda_graph else ""))
    # every kernel checked against the cards' launch limits before code generation
    check = launch_check(target.launch_devices()) if target.is_gpu else None
    context = tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True} if cuda_graph else None,
                                        instruments=[check] if check else None)
    with compile_target, context, quick_stack():    # TVM parses TVMScript (intrinsics) on the way
        mod = lowered.mod if cuda_graph else round_rows(bound_functions(lowered.mod, bounds),
                                                        request.spec.deployment.max_batch)
        mod = relax_pipeline(compile_target, schedule, target.schedule_device(),
                             [] if cuda_graph else [round_output_storage()])(mod)
        instrument("relax-pipeline", mod)
        try:
            executable = tvm.compile(mod, target=compile_target, relax_pipeline=None)
        except Exception:  # TVM passes the instrument's error on as its own type
            if check is not None and check.failure is not None:
                raise check.failure from None
            raise
    return executable, mod, (check.summary() if check else None)


def _export(executable, mod, lowered: Lowered, request: BuildRequest, out_dir: Path) -> dict:
    """Write model.so, kernels.json, params and the tokenizer; returns the files' facts for the manifest."""
    import tvm

    kernels = tvm.IRModule({gv: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)})
    (out_dir / "kernels.json").write_text(tvm.ir.save_json(kernels))   # the cost model reads FLOPs/bytes here
    lib_path = out_dir / "model.so"
    executable.export_library(str(lib_path))
    files = {"hashes": {"model.so": file_digest(lib_path)}, "aliases": {}, "tokenizer": None}
    if request.params == "load":
        files["weights"] = weights_reference(request.spec)
        files["weights"]["params_sha256"] = params_digest(lowered.context.params)
        adapter = request.spec.drafter.adapter
        if adapter:      # small, and part of the drafter: it travels with the build
            shutil.copyfile(request.spec.resolve(adapter, "drafter.adapter"), out_dir / "adapter.safetensors")
            files["hashes"]["adapter.safetensors"] = file_digest(out_dir / "adapter.safetensors")
    if lowered.feature_drafter is not None:   # small: it travels with the build, in its published layout
        from specpilot.core import feature_drafter as fd
        from specpilot.core.adapter import target_digest
        weights = lowered.target_model.weights
        fd.save(out_dir / "drafter", *lowered.feature_drafter, lowered.target_model.cfg.num_hidden_layers,
                target_digest(weights) if weights else None, dtype=getattr(torch, request.spec.deployment.dtype))
        for name in ("config.json", "model.safetensors"):
            if (out_dir / "drafter" / name).is_file():    # a seeded build's drafter is drawn from its seed
                files["hashes"][f"drafter/{name}"] = file_digest(out_dir / "drafter" / name)
    if request.params == "file":       # other builds: the engine works out aliases when it makes the weights
        stored, files["aliases"] = dedupe(lowered.context.params)
        (out_dir / "params").mkdir(exist_ok=True)
        params_path = out_dir / "params" / "params.safetensors"
        save_file(stored, str(params_path), metadata={"format": "pt"})
        files["hashes"]["params/params.safetensors"] = file_digest(params_path)
    tokenizer = lowered.target_model.tokenizer_path
    if tokenizer is not None:
        src = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
        shutil.copyfile(src, out_dir / "tokenizer.json")
        files["tokenizer"] = "tokenizer.json"
        template = chat_template(src.parent)
        if template is not None:     # what the server renders chat messages with
            (out_dir / "chat_template.jinja").write_text(template)
            files["chat_template"] = "chat_template.jinja"
    return files


def chat_template(directory: Path) -> str | None:
    """A checkpoint's chat template: chat_template.jinja, or tokenizer_config.json's chat_template."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text()).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
        return template if isinstance(template, str) else None
    return None


def _manifest(request: BuildRequest, lowered: Lowered, effects: dict, compiled_mod, schedule: str,
              cuda_graph: bool, system_ir_hash: str, files: dict, seconds: float, launch: dict | None,
              bounds: dict) -> Manifest:
    spec, target, d = request.spec, request.target, request.spec.drafter
    serving = {"draft_len": d.draft_len, **effects.get("serving", {})}
    if "serving" in effects and effects.get("tree"):   # a tree's draft length: nodes a request takes a pass
        serving["draft_nodes"] = serving["draft_len"] or effects["tree"]["budget"]
    serving["draft_len"] = serving["draft_len"] or d.draft_len        # length 0: the spec's
    tgt, drf = lowered.target_model, lowered.drafter_model
    seeds = {"target": spec.target.init.model_dump() if spec.target.init else None,
             "drafter": drafter_init(d).model_dump() if drafter_init(d) else None}
    functions = sorted(gv.name_hint for gv in compiled_mod.get_global_vars()
                       if gv.name_hint.startswith(("target_", "drafter_")) or gv.name_hint in ("sample_scores", "choose"))
    return Manifest(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        spec=spec.model_dump(mode="json", exclude={"path"}), spec_path=str(spec.path) if spec.path else None,
        pipeline=str(lowered.pipeline), passes=[vars(r) for r in lowered.records],
        target=target.text(), target_kind=target.kind, arch=target.arch, cpu=target.cpu, dtype=spec.deployment.dtype,
        capacity=spec.deployment.max_seq_len, max_batch=spec.deployment.max_batch,
        schedule=schedule, cuda_graph=cuda_graph, ir_hash=system_ir_hash, serving=serving,
        tree=effects.get("tree"), two_level=bool(effects.get("two_level")), node_budget=effects.get("node_budget"),
        admission=effects.get("admission"), gdn_verify=effects.get("gdn_verify"),
        w12=effects.get("w12"), fused=effects.get("fused"),
        models={"target": tgt.cfg.to_dict(), **({"drafter": drf.cfg.to_dict()} if drf else {})},
        features=list(lowered.feature_drafter[0].target_layers) if lowered.feature_drafter else None,
        drafter={"kind": d.kind, "draft_len": d.draft_len, "top_k": d.top_k, "temperature": d.temperature,
                 "max_ngram": d.max_ngram, "min_ngram": d.min_ngram, "replay": replay_plan(spec)},
        functions=functions, params=list(lowered.context.params), versions=_versions(),
        params_source=request.params, seeds=seeds, build_seconds=round(seconds, 2), launch=launch,
        caches={which: _caches(model.cfg, spec.deployment) for which, model in (("target", tgt), ("drafter", drf)) if model},
        memory_bounds={name: b for name, b in bounds.items() if name in functions}, **files)


def memory_bounds(spec: Spec, effects: dict) -> dict[str, dict[str, int]]:
    """The step functions' dimension bounds for this deployment and pipeline (`compiler.memory_bounds`)."""
    from specpilot.compiler.memory_bounds import step_bounds, verify_rows

    tree, serving, admission = effects.get("tree") or {}, effects.get("serving") or {}, effects.get("admission") or {}
    rows = verify_rows(tree.get("budget"), serving.get("draft_len") or spec.drafter.draft_len, admission.get("chunk"))
    return step_bounds(spec.deployment.max_batch, spec.deployment.max_seq_len, rows if tree.get("packed") else None)


def _caches(cfg, deployment) -> dict:
    shapes = cache_shapes(cfg, deployment.max_seq_len, deployment.max_batch, deployment.dtype)
    return {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in shapes.items()}


def build(request: BuildRequest, progress=None) -> Manifest:
    """Lower, apply the pipeline, compile and export into ``request.out_dir``.  Returns the manifest."""
    say = progress or (lambda message: None)
    spec, started = request.spec, time.perf_counter()
    if request.params not in ("file", "seeded", "load"):
        raise SpecPilotError(f"params must be 'file', 'seeded' or 'load', not {request.params!r}")
    if request.params == "load":
        weights_reference(spec)          # refused up front when the weights cannot be referenced
    if request.params == "seeded" and not seeded_models(spec):
        raise SpecPilotError("params='seeded' needs seeded random models (init: {seed: N}) for target and drafter")
    stages: list[tuple[str, object]] = []

    def instrument(stage: str, module) -> None:
        stages.append((stage, module))
        if request.print_ir_after in (stage, "all"):
            print(f"# IR after {stage}\n{module.script(show_meta=False)}", file=sys.stderr)
        if request.dump_ir is not None:
            request.dump_ir.mkdir(parents=True, exist_ok=True)
            (request.dump_ir / f"{len(stages):02d}-{stage}.py").write_text(module.script(show_meta=False))

    lowered = lower_and_apply(spec, request.target, request.passes or spec.passes, request.params, say,
                              instrument, after_pass=instrument)
    system_ir_hash = system_identity(lowered)
    effects = pass_effects(lowered)
    schedule, cuda_graph = _schedule(request, effects)
    # a CUDA-graph build's capture takes its statically planned regions, keyed by their dimensions: left as is
    bounds = {} if cuda_graph else memory_bounds(spec, effects)
    executable, compiled_mod, launch = _compile(lowered, request, schedule, cuda_graph, bounds, say, instrument)
    out_dir = Path(request.out_dir)
    staging = _staging_dir(out_dir)
    say("exporting")
    try:
        files = _export(executable, compiled_mod, lowered, request, staging)
        manifest = _manifest(request, lowered, effects, compiled_mod, schedule, cuda_graph, system_ir_hash, files,
                             time.perf_counter() - started, launch, bounds)
        write_manifest(staging, manifest)
        swap_in_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _staging_dir(out_dir: Path) -> Path:
    """A fresh sibling of ``out_dir`` the build is written into before it replaces ``out_dir`` -- only
    an empty folder or an earlier build is replaced, never a folder with anything else in it."""
    if out_dir.exists() and not (out_dir.is_dir() and (not any(out_dir.iterdir())
                                                       or (out_dir / "manifest.json").is_file())):
        raise SpecPilotError(f"{out_dir}: exists and is not a SpecPilot build; give -o a new or empty folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.iterdir():     # what a killed build of this folder left beside it
        if stale.name.startswith((f".{out_dir.name}.building-", f".{out_dir.name}.old-")):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))


