"""A `Server` for a build directory: its system, engine, served name and chat template."""

from __future__ import annotations

from pathlib import Path

from specpilot.core.errors import SpecPilotError
from specpilot.core.hub import is_hub_id
from specpilot.core.manifest import read_manifest
from specpilot.runtime.systems import from_build
from specpilot.serve.app import Server


def served_name(build_dir: Path, spec: dict) -> str:
    """The target's Hugging Face id when the spec named one, else the build's folder name."""
    checkpoint = (spec.get("target") or {}).get("checkpoint")
    if isinstance(checkpoint, str) and is_hub_id(checkpoint):
        return checkpoint
    return Path(build_dir).resolve().name


def best_engine(engines) -> str:
    for name in ("compiled-two-level", "compiled-tree", "compiled-spec", "compiled"):
        if name in engines:
            return name
    raise SpecPilotError("this build has no compiled engine to serve")


def make_server(build_dir: Path, engine: str | None, name: str | None, chat_template: Path | None,
                queue_size: int, seed: int = 0) -> Server:
    manifest = read_manifest(build_dir)
    system = from_build(build_dir)
    engine = engine or best_engine(system.engines)
    if engine not in system.engines:
        raise SpecPilotError(f"{build_dir}: no engine {engine!r} in this build; it has {', '.join(system.engines)}")
    if chat_template is not None:
        template = chat_template.read_text()
    elif manifest.chat_template:
        template = (Path(build_dir) / manifest.chat_template).read_text()
    else:
        template = None
    return Server(system, engine, name or served_name(build_dir, manifest.spec), template, queue_size, seed)
