"""The build manifest: the contract between a build and everything that runs it (the Python engine,
the memory, the cost model; no TVM needed to read it).

A build directory holds ``model.so``, ``params/``, an optional ``tokenizer.json`` and
``manifest.json``, whose fields are `Manifest`'s.  Every pass whose effect the runtime must know
records it here (`Pass.manifest_key`): the tree budget (``tree``), two-level verification
(``two_level``), the serving schedule (``serving``), the batch schedule (``node_budget``, ``admission``), W12 planes (``w12``), fused projections
(``fused``), the Gated DeltaNet tree form (``gdn_verify``) and the kernel schedule.  Readers take
facts from these fields, never from the pipeline text.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specpilot.core.acceptance_profile import check_accepted, check_confidence
from specpilot.core.cpu_level import Level
from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_write_text

FORMAT = "specpilot-build"
DIGEST = "manifest.sha256"
VERSION = 4     # 4: typed manifest, pass effects recorded as fields (tree, two_level, serving, kernel_schedule)
FILE = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Serving(_Strict):
    """The draft-length policy (`draft-length`): fixed, or per request from recent acceptance."""
    draft_len: int = Field(ge=1)
    draft_dynamic: bool = False
    draft_min: int = Field(1, ge=1)
    draft_step: int = Field(1, ge=1)
    draft_priced: bool = False                    # batched passes: a chain length / tree nodes by cost (`runtime.pass_cost`)
    draft_nodes: int | None = Field(None, ge=1)   # with a tree: nodes a request takes a pass at most


class NodeBudget(_Strict):
    """A batched verification pass's drafted nodes in all (`node-budget`)."""
    nodes: int = Field(ge=1)
    min_prob: float = Field(0.0, ge=0.0, lt=1.0)


class Admission(_Strict):
    """Waiting prompts in chunks of at most ``chunk`` tokens ride along in verification passes, while
    the backlog fits ``passes`` chunks; a larger one joins by a prefill pass of its own."""
    chunk: int = Field(ge=1)
    passes: int = Field(4, ge=1)


class TreeVerify(_Strict):
    budget: int = Field(ge=1)          # nodes a verification takes (`tree-verify`)
    fixed_tokens: int | None = Field(None, ge=2)   # tokens of target_verify_tree (`tree-verify{fixed=true}`)
    packed: bool = False               # target_verify_packed (`tree-verify{packed=true}`)


class GdnVerify(_Strict):
    form: Literal["chunked", "sequential"]
    max_tokens: int | None = None      # the most tokens one recording verification may take


class DrafterInfo(_Strict):
    kind: str
    draft_len: int
    top_k: int
    temperature: float = 1.0
    max_ngram: int
    min_ngram: int
    # a replay drafter's plan: {"accepted": [[...], ...]} or {"alpha", "seed"}, and "confidence" pools
    replay: dict | None = None

    @field_validator("replay")
    @classmethod
    def _plan(cls, plan: dict | None) -> dict | None:
        if plan is None:
            return None
        try:
            alpha = plan.get("alpha")
            if ("accepted" in plan) == ("alpha" in plan):
                raise SpecPilotError("a replay plan takes one of 'accepted' counts or an 'alpha' in [0, 1]")
            if "accepted" in plan:
                check_accepted(plan["accepted"], "drafter.replay")
            elif not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
                raise SpecPilotError("a replay plan's 'alpha' is a rate in [0, 1]")
            if "confidence" in plan:
                check_confidence(plan["confidence"], "drafter.replay")
        except SpecPilotError as e:
            raise ValueError(str(e)) from None      # pydantic reports the field
        return plan


class Cache(_Strict):
    """One of a model's caches (`core.config.cache_shapes`): its shape and element type.  ``kv`` is
    the pool of max_batch sequence rows; ``conv`` / ``rec`` are one sequence's recurrent states."""
    shape: list[int]
    dtype: str


class Manifest(_Strict):
    format: Literal["specpilot-build"] = FORMAT
    version: int = VERSION
    created: str
    spec: dict
    spec_path: str | None = None
    pipeline: str                      # canonical text: the build's identity, not read for facts
    passes: list[dict]                 # per-pass records: name, options, statistics, seconds
    target: str
    target_kind: Literal["llvm", "cuda"]
    arch: str | None = None
    cpu: Level | None = None           # llvm: the x86-64 level its code needs (`core.cpu_level`)
    dtype: Literal["float32", "bfloat16", "float16"]
    capacity: int = Field(ge=1)
    max_batch: int = Field(ge=1)
    schedule: str
    cuda_graph: bool = False
    ir_hash: str
    serving: Serving
    tree: TreeVerify | None = None
    two_level: bool = False
    node_budget: NodeBudget | None = None
    admission: Admission | None = None
    gdn_verify: GdnVerify | None = None
    w12: dict | None = None
    fused: dict | None = None
    models: dict[str, dict]
    features: list[int] | None = None  # target layers whose outputs its steps return (a drafter in drafter/ reads them)
    drafter: DrafterInfo
    functions: list[str]
    params: list[str]
    aliases: dict[str, str] = {}
    tokenizer: str | None = None
    chat_template: str | None = None   # the target's chat template file (the server renders chat with it)
    versions: dict[str, str | None]
    params_source: Literal["file", "seeded", "load"] = "file"
    weights: dict | None = None        # params_source "load": {kind, path, sha256, params_sha256}
    seeds: dict
    hashes: dict[str, str]
    build_seconds: float = 0.0
    launch: dict | None = None         # CUDA: the launch-limit check's cards, kernel count, largest kernels
    caches: dict[str, dict[str, Cache]] | None = None   # per model: what a runtime allocates (the C++ one reads it)
    # per step function, its dimensions' upper bounds (`compiler.memory_bounds`): a call must stay inside them
    memory_bounds: dict[str, dict[str, int]] = {}

    @property
    def tree_budget(self) -> int:
        return self.tree.budget if self.tree else 0


def read_manifest(build_dir: Path | str) -> Manifest:
    path = Path(build_dir) / FILE
    if not path.is_file():
        raise SpecPilotError(f"{build_dir}: not a build directory (no {FILE}); run `specpilot compile` first")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecPilotError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecPilotError(f"{path}: not a SpecPilot build manifest")
    if data.get("version") != VERSION:
        raise SpecPilotError(f"{path}: build format version {data.get('version')}, this SpecPilot reads "
                             f"version {VERSION}; rebuild with `specpilot compile`")
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise SpecPilotError(f"{path}: field {field!r}: {first['msg']}") from None
    _check_digest(path)
    required = {"model.so"} | ({"params/params.safetensors"} if manifest.params_source == "file" else set())
    missing = sorted(required - set(manifest.hashes))
    if missing:
        raise SpecPilotError(f"{path}: field 'hashes' has no entry for {missing[0]}; the build cannot be checked")
    return manifest


def _check_digest(path: Path) -> None:
    """manifest.json against manifest.sha256, written beside it: an edited manifest (its hashes taken
    out, say) is refused, so the manifest's checks cannot be switched off."""
    sidecar = path.with_name(DIGEST)
    if not sidecar.is_file():
        raise SpecPilotError(f"{path}: no {DIGEST} beside it (a build from an older SpecPilot?); compile it again")
    want = sidecar.read_text(errors="replace").strip()
    if hashlib.sha256(path.read_bytes()).hexdigest() != want:
        raise SpecPilotError(f"{path}: does not match {DIGEST} (edited or corrupt); compile it again")


def write_manifest(build_dir: Path | str, manifest: Manifest) -> None:
    path = Path(build_dir) / FILE
    atomic_write_text(path, manifest.model_dump_json(indent=2))
    atomic_write_text(path.with_name(DIGEST), hashlib.sha256(path.read_bytes()).hexdigest() + "\n")
