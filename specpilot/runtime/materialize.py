"""A build that carries its weights, made from one that makes them at load time (``--params seeded``
redraws them from the manifest's seeds, ``--params load`` reads the referenced checkpoint): the same
model.so and kernels, the parameters written to params/params.safetensors as the engine made them.
What the C++ runtime reads (it has no PyTorch to redraw or convert weights with)."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file

from specpilot.core.errors import SpecPilotError
from specpilot.core.manifest import write_manifest
from specpilot.core.weights import file_digest
from specpilot.runtime.engine import CompiledModule


def materialize(build_dir: Path, out_dir: Path) -> Path:
    build_dir, out_dir = Path(build_dir), Path(out_dir)
    module = CompiledModule(build_dir)      # checks the build and makes its parameters
    manifest = module.manifest
    if manifest.params_source == "file":
        raise SpecPilotError(f"{build_dir}: already carries its weights (params/params.safetensors)")
    if out_dir.exists():
        raise SpecPilotError(f"{out_dir}: exists; give a new folder")
    stored, aliases = module.stored_parameters()
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(build_dir, staging)
        (staging / "params").mkdir(exist_ok=True)
        params = staging / "params" / "params.safetensors"
        save_file({name: t.detach().contiguous().cpu() for name, t in stored.items()}, str(params),
                  metadata={"format": "pt"})
        hashes = {**manifest.hashes, "params/params.safetensors": file_digest(params)}
        write_manifest(staging, manifest.model_copy(update={"params_source": "file", "aliases": aliases,
                                                            "hashes": hashes, "weights": None}))
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
