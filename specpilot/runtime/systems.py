"""Systems that generate: a target, a drafter, a tokenizer, and the engines that drive them.

- from a spec: ``stock`` (greedy autoregressive on the PyTorch reference) and ``stock-spec``
  (chain speculative decoding on the reference);
- from a build directory: the same two stock engines on the build's own weights, plus
  ``compiled`` and ``compiled-spec`` running the compiled module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specpilot.core.errors import SpecPilotError
from specpilot.core.pipeline_text import tree_budget
from specpilot.core.sampling import MASKED, SamplingParams
from specpilot.core.spec import conditioned_source, replay_plan
from specpilot.runtime.batching import Arrival, BatchPolicy, BatchRun, StepClock, run_batch
from specpilot.runtime.decoding import (Generation, autoregressive, speculative, speculative_tree,
                                        speculative_two_level, teacher_forced)
from specpilot.runtime.drafters import ModelDrafter, NGramDrafter
from specpilot.runtime.feature_drafters import BlockDrafter, FeatureDrafter
from specpilot.runtime.reference.feature_nets import build_net
from specpilot.runtime.lattice import LatticeRecorder, LatticeReplayer
from specpilot.runtime.reference.model import ReferenceModel
from specpilot.runtime.replay import Oracle, ReplayDrafter
from specpilot.runtime.sampling import sampled
from specpilot.runtime.threads import torch_threads
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.runtime.draft_schedule import DraftSchedule, lengths

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CUT = abs(MASKED) / 2      # a score this far out is a token top-k / top-p cut, not a logit


def near_tie_budget(positions: int, unresolved: int) -> int:
    """The most excused near-ties a correct low-precision build is allowed (`System.derived_near_ties`)."""
    return max(4 * unresolved + 8, positions // 50)


def margin_error(run: Generation, pos: int, logits: torch.Tensor) -> float | None:
    """How far ``run``'s margin at ``pos`` (its top 2's difference) is from the same two tokens'
    difference in ``logits`` (float32 scores of that position).  Sampled runs: a runner-up both
    precisions cut is a decision both resolve (0); one only one precision cuts (top-k / top-p at its
    boundary) is open (None: it sets no tolerance)."""
    first, second = run.choices[pos], run.runner_up[pos]
    a, b, margin = float(logits[first].float()), float(logits[second].float()), run.margins[pos]
    cut_here, cut_there = margin >= CUT, abs(b) >= CUT or abs(a) >= CUT
    if cut_here and cut_there:
        return 0.0
    if cut_here or cut_there:
        return None
    return abs(margin - (a - b))


class Deferred:
    """A model made on first use: a build's stock reference decodes and holds a second copy of the
    weights (52 GB for a 27B-class bf16 model beside its W12 planes), which only stock rows need."""

    def __init__(self, make: Callable[[], object]):
        self._make, self._model = make, None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self._model is None:
            self._model = self._make()
        return getattr(self._model, name)


@dataclass
class Engine:
    model: object                                # ReferenceModel or CompiledModel
    drafter: Callable[[], object] | None = None  # builds a fresh drafter; None: autoregressive
    tree_budget: int = 0                         # > 0: best-first tree verification with this many nodes
    two_level: bool = False                      # tree drafts checked first through the nested 8-bit view
    batch: BatchSchedule | None = None           # in a batch: the build's node budget, draft lengths, admission
    host_threads: int | None = None              # torch's threads while it runs (`runtime.threads`); None: as set


@dataclass(frozen=True)
class BatchSchedule:
    """The batch mechanisms a build chose (`node-budget`, `draft-length`, `prompt-admission`)."""
    nodes: int                                   # a request's nodes a pass at most (its longest draft)
    budget: int                                  # a pass's drafted nodes in all
    min_prob: float = 0.0
    lengths: tuple[int, ...] | None = None       # dynamic draft lengths
    chunk: int | None = None                     # prompt admission's chunk
    passes: int = BatchPolicy.passes             # and the backlog, in chunks, that rides along


class Engines(dict):
    """Engines by name; a factory registered with ``later`` builds its engine on first use (the
    float32 reference beside a bf16 build is twice the weights' memory and serves only the
    tie tolerance)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.factories: dict[str, Callable[[], Engine]] = {}

    def later(self, name: str, factory: Callable[[], Engine]) -> None:
        self.factories[name] = factory

    def __missing__(self, name: str) -> Engine:
        if name not in self.factories:
            raise KeyError(name)
        self[name] = self.factories.pop(name)()
        return self[name]


class System:
    def __init__(self, engines: dict[str, Engine], tokenizer, capacity: int, draft_len: int,
                 eos_ids: tuple[int, ...], dtype: str, draft_min: int = 1, draft_dynamic: bool = False,
                 draft_step: int = 1, setup: DrafterSetup | None = None, oracle: Oracle | None = None, draft_reference=None,
                 node_budget: int | None = None, draft_priced: bool = False):
        self.engines, self.tokenizer, self.capacity = engines, tokenizer, capacity
        self.draft_len, self.eos_ids, self.dtype = draft_len, eos_ids, dtype
        self.draft_min, self.draft_dynamic = draft_min, draft_dynamic   # the draft-length schedule
        self.draft_step, self.draft_priced = draft_step, draft_priced   # priced: batched chains / trees by cost
        self.node_budget = node_budget      # a build's drafted tokens a batched pass (`node-budget`), None: no cap
        self.setup, self.draft_reference = setup, draft_reference
        self.drafter_source: dict | None = None   # a block / feature drafter's directory and weights digest
        self.oracle = oracle or Oracle()     # replay drafters' continuations
        self._hf: dict[str, tuple] = {}

    @property
    def vocab_size(self) -> int:
        return self.engines["stock"].model.vocab_size

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise SpecPilotError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise SpecPilotError(f"prompt token {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def autoregressive_engine(self) -> str:
        return "compiled" if "compiled" in self.engines else "stock"

    def hf_engines(self) -> list[str]:
        """The transformers reference rows this system can run: greedy ``generate`` always, eager and
        with a static cache under ``torch.compile``; assisted generation for an n-gram drafter (prompt
        lookup) or a draft model, on targets without recurrent state (transformers refuses assisted
        generation on stateful models)."""
        names = ["hf-generate", "hf-compiled"]
        cfg = self.engines["stock"].model.cfg
        kind = self.setup.kind if self.setup else None
        if not cfg.is_hybrid and (kind == "ngram" or (kind == "model" and self.draft_reference is not None)):
            names.append("hf-assisted")
        return names

    def hf_models(self, name: str) -> tuple:
        """(transformers model, assisted-generation arguments) for a reference row, made once."""
        from specpilot.runtime.hf_reference import hf_model

        if name not in self.hf_engines():
            raise SpecPilotError(f"no transformers row {name!r} for this system; available: {', '.join(self.hf_engines())}")
        if name == "hf-compiled":     # the same model; generate compiles it for a static cache
            return self.hf_models("hf-generate")
        if name not in self._hf:
            ref = self.engines["stock"].model
            model = hf_model(ref.cfg, ref.w, ref.dtype, ref.device)
            assist = {}
            if name == "hf-assisted" and self.setup.kind == "ngram":
                assist = {"prompt_lookup_num_tokens": self.draft_len, "max_matching_ngram_size": self.setup.max_ngram}
            elif name == "hf-assisted":
                d = self.draft_reference
                assist = {"assistant_model": hf_model(d.cfg, d.w, d.dtype, d.device)}
            self._hf[name] = (model, assist)
        return self._hf[name]

    def derived_tie_tolerance(self, prompts: list[list[int]], stock_runs: list[Generation]) -> float:
        """The tie tolerance stock's own arithmetic justifies: the largest error of stock's top-2
        margin against the same model in float32 (forced onto stock's tokens), over these
        requests.  Where stock's margin is below it, stock's own choice is not resolved by its
        precision, so a system choosing the runner-up there is excused (and listed).  0 in fp32.
        Stock's margins and top-2 tokens come from ``stock_runs`` (unforced stock runs); only the
        float32 model runs again, teacher-forced on each run's tokens (`decoding.teacher_forced`)."""
        return self.derived_near_ties(prompts, stock_runs)[0]

    def derived_near_ties(self, prompts: list[list[int]], stock_runs: list[Generation],
                          sampling: SamplingParams | None = None) -> tuple[float, int | None]:
        """(the tie tolerance, the near-tie budget).  The tolerance is a maximum over positions, so
        one unstable position can make it large for every position (2 logits on the tiny bf16
        hybrid); the budget bounds how many near-ties may be excused: 4 x the positions where
        stock's margin is below its own error there (decisions stock's precision leaves open) + 8,
        and at least 2 % of the positions (None in fp32: nothing is excused).  A build with a wrong
        verify mismatches nearly every position of a tree run under that tolerance (483 of 512; the
        correct build of the same spec 40-43: docs/bench-log.md)."""
        if self.dtype == "float32":
            return 0.0, None
        exact = sampled(self.engines["stock-fp32"].model, sampling)   # margins of the same scores
        worst, unresolved, positions = 0.0, 0, 0
        for prompt, run in zip(prompts, stock_runs):
            if run.choices != run.tokens or len(run.runner_up) != len(run.tokens):
                raise SpecPilotError("the tie tolerance is derived from stock's own unforced runs")
            rows = teacher_forced(exact, prompt, run.tokens, self.capacity)
            errors = [margin_error(run, pos, row) for pos, row in enumerate(rows)]
            worst = max([worst, *(e for e in errors if e is not None)])
            unresolved += sum(e is None or m < e for m, e in zip(run.margins, errors))
            positions += len(errors)
        return worst, near_tie_budget(positions, unresolved)

    def batch_policy(self, engine: str, max_batch: int | None = None, queue: int | None = None) -> BatchPolicy:
        """How ``engine`` runs in a continuous batch of at most ``max_batch`` (default: the build's
        deployment.max_batch): autoregressive, chains of the draft length (dynamic where the build's
        draft-length says; sharing the build's node budget where it has one), trees of the tree budget
        each, or trees under the build's batch schedule."""
        e = self._engine(engine)
        if e.two_level:
            raise SpecPilotError(f"engine {engine!r}: batched runs take autoregressive, chain and tree engines, "
                                 "not two-level verification")
        rows = getattr(e.model, "max_batch", None)
        if max_batch and rows and max_batch > rows:
            raise SpecPilotError(f"a batch of {max_batch}: this build holds {rows} sequence(s) at once "
                                 "(deployment.max_batch)")
        limit = max_batch or rows or 1
        if e.drafter is None:
            return BatchPolicy("ar", limit, queue=queue)
        if not e.tree_budget:
            dynamic = lengths(self.draft_len, self.draft_min, self.draft_step) if self.draft_dynamic else None
            return BatchPolicy("chain", limit, self.draft_len, self.node_budget, lengths=dynamic, queue=queue,
                               adaptive=self.draft_priced)
        b = e.batch
        if b is None:
            return BatchPolicy("tree", limit, e.tree_budget, queue=queue, adaptive=self.draft_priced)
        return BatchPolicy("tree", limit, b.nodes, b.budget, b.min_prob, b.lengths, b.chunk, queue, passes=b.passes,
                           adaptive=self.draft_priced)

    def serve(self, engine: str, arrivals: list[Arrival], policy: BatchPolicy, clock=None, forces=None,
              logits_hook=None, sampling: SamplingParams | None = None, parts=None) -> BatchRun:
        """``arrivals`` through one continuous batch on ``engine`` under ``policy`` (`runtime.batching`;
        ``parts``: a `cycle_timing.Clock` for the passes' split)."""
        e = self._engine(engine)
        for a in arrivals:
            self.check_prompt(list(a.prompt))
            if len(a.prompt) + a.max_new > self.capacity:
                raise SpecPilotError(f"prompt ({len(a.prompt)}) + max new tokens ({a.max_new}) exceeds "
                                     f"deployment.max_seq_len={self.capacity}")
        if e.drafter is not None and self.setup is not None and self.setup.kind == "replay":
            for i, a in enumerate(arrivals):     # the replay drafter follows each prompt's own continuation
                if not self.oracle.has(list(a.prompt)):
                    tokens = forces[i] if forces is not None and forces[i] is not None else \
                        self.generate(self.autoregressive_engine(), list(a.prompt), a.max_new, sampling=sampling).tokens
                    self.oracle.register(list(a.prompt), tokens)
        make = (lambda: e.drafter(sampling)) if e.drafter is not None else None
        with torch_threads(e.host_threads):
            return run_batch(sampled(e.model, sampling), make, arrivals, policy, self.capacity, clock, forces,
                             logits_hook, parts=parts)

    def generate_batch(self, engine: str, prompts: list[list[int]], max_new: list[int], forces=None,
                       logits_hook=None, max_batch: int | None = None,
                       sampling: SamplingParams | None = None) -> list[Generation]:
        """The requests as one continuous batch, all arriving at once (at most ``max_batch`` running;
        default: the build's deployment.max_batch), under the engine's batch policy."""
        arrivals = [Arrival(0.0, tuple(p), n) for p, n in zip(prompts, max_new)]
        rows = getattr(self._engine(engine).model, "max_batch", None)     # the stock reference has no pool
        run = self.serve(engine, arrivals, self.batch_policy(engine, max_batch or (None if rows else len(prompts))),
                         StepClock(), forces, logits_hook, sampling)
        return run.generations

    def _engine(self, engine: str) -> Engine:
        if engine not in self.engines:
            raise SpecPilotError(f"unknown engine {engine!r} here; available: {', '.join(self.engines)}")
        return self.engines[engine]

    def generate(self, engine: str, prompt: list[int], max_new: int, force=None, logits_hook=None,
                 stop_at_eos: bool = False, record_lattices: Path | None = None,
                 replay_lattices: Path | None = None, sampling: SamplingParams | None = None,
                 on_token=None) -> Generation:
        """One request on ``engine``; greedy, or sampled under ``sampling`` (`runtime.sampling`: the
        same tokens on every engine for the same seed).  ``on_token(token)`` hears each token as it
        is decided; returning False ends the request there."""
        if engine not in self.engines:
            raise SpecPilotError(f"unknown engine {engine!r} here; available: {', '.join(self.engines)}")
        self.check_prompt(prompt)
        if len(prompt) + max_new > self.capacity:
            raise SpecPilotError(f"prompt ({len(prompt)}) + max new tokens ({max_new}) exceeds "
                                 f"deployment.max_seq_len={self.capacity}")
        stop_ids = self.eos_ids if stop_at_eos else ()
        e = self.engines[engine]
        if self.setup is not None and self.setup.kind == "replay" and e.drafter is not None \
                and not self.oracle.has(prompt):
            self.oracle.register(prompt, force if force is not None else
                                 self.generate(self.autoregressive_engine(), prompt, max_new, sampling=sampling).tokens)
        with torch_threads(e.host_threads):
            return self._generate(e, prompt, max_new, force, logits_hook, stop_ids, record_lattices, replay_lattices,
                                  sampling, on_token)

    def _generate(self, e: Engine, prompt, max_new, force, logits_hook, stop_ids, record_lattices, replay_lattices,
                  sampling, on_token) -> Generation:
        model = sampled(e.model, sampling)
        if e.drafter is None:
            return autoregressive(model, prompt, max_new, self.capacity, force, logits_hook, stop_ids, on_token=on_token)
        own = e.drafter(sampling)   # per generation: a compiled drafter holds a KV-cache row only while it runs
        drafter = LatticeReplayer(replay_lattices, self.vocab_size) if replay_lattices else own
        if record_lattices:
            drafter = LatticeRecorder(drafter, record_lattices, prompt)
        try:
            if e.tree_budget:
                if record_lattices or replay_lattices:
                    raise SpecPilotError("lattice recording/replay covers chain drafting; use a -spec engine")
                if e.two_level:
                    return speculative_two_level(model, drafter, prompt, max_new, e.tree_budget, self.capacity,
                                                 force, logits_hook, stop_ids, on_token)
                return speculative_tree(model, drafter, prompt, max_new, e.tree_budget, self.capacity,
                                        force, logits_hook, stop_ids, on_token)
            schedule = DraftSchedule(self.draft_len, self.draft_min, self.draft_dynamic, step=self.draft_step)
            return speculative(model, drafter, prompt, max_new, schedule, self.capacity,
                               force, logits_hook, stop_ids, on_token)
        finally:
            if record_lattices:
                drafter.close()
            if hasattr(own, "state"):
                own.state = None
            if hasattr(own, "close"):     # a block drafter's pooled cache row goes back
                own.close()


@dataclass
class DrafterSetup:
    """How a system's drafters are made (the spec's or the manifest's drafter options)."""
    kind: str
    top_k: int
    capacity: int
    max_ngram: int = 4
    min_ngram: int = 1
    temperature: float = 1.0
    replay: dict | None = None        # a replay drafter's plan (`runtime.replay`)
    cost_kind: str = "model"          # a replay drafter's cost network: a model's, or a block drafter's

    def factory(self, model, oracle: Oracle, vocab_size: int) -> Callable[..., object]:
        """A fresh drafter per generation: n-gram, a model's (the drafter network), or a replay drafter
        spending a model drafter's time.  Called with the request's sampling, a drafter network
        samples with the same keyed noise as the target (so it proposes what the target will draw
        where the two agree)."""
        if self.kind == "ngram":
            return lambda sampling=None: NGramDrafter(self.max_ngram, self.min_ngram, self.top_k)
        if self.kind in ("block", "feature"):    # ``model``: the drafter network (`feature_nets.build_net`)
            kind = BlockDrafter if self.kind == "block" else FeatureDrafter
            return lambda sampling=None: kind(model, self.top_k, self.capacity, self.temperature)
        network = lambda sampling=None: ModelDrafter(sampled(model, sampling), self.top_k,  # noqa: E731
                                                     self.capacity, name=self.kind, temperature=self.temperature)
        if self.kind == "replay" and self.cost_kind == "block":
            return lambda sampling=None: ReplayDrafter(BlockDrafter(model, self.top_k, self.capacity, self.temperature),
                                                       oracle, self.replay, self.top_k, vocab_size)
        if self.kind == "replay":
            return lambda sampling=None: ReplayDrafter(network(sampling), oracle, self.replay, self.top_k, vocab_size)
        return network


def from_spec(spec) -> System:
    from specpilot.core.loader import conditioned_drafter, load_models

    dtype = DTYPES[spec.deployment.dtype]
    target, drafter = load_models(spec)
    capacity, d = spec.deployment.max_seq_len, spec.drafter
    net = conditioned_drafter(spec, target) if conditioned_source(d) else None
    reference = ReferenceModel(target.cfg, target.weights, dtype, feature_layers=net[0].target_layers if net else None)
    draft_model = ReferenceModel(drafter.cfg, drafter.weights, dtype) if drafter else None
    if net:
        draft_model = build_net(*net, target.weights, dtype, "cpu")
    setup = DrafterSetup(d.kind, d.top_k, capacity, d.max_ngram, d.min_ngram, d.temperature, replay_plan(spec),
                         d.cost.kind if d.cost is not None else "model")
    oracle = Oracle()
    make = setup.factory(draft_model, oracle, target.cfg.vocab_size)
    engines = Engines({"stock": Engine(reference), "stock-spec": Engine(reference, make)})
    budget = tree_budget(spec.passes)
    if budget:
        engines["stock-tree"] = Engine(reference, make, budget)
    if dtype != torch.float32:
        engines.later("stock-fp32", lambda: Engine(ReferenceModel(target.cfg, target.weights, torch.float32,
                                                                  weight_format="stored")))
    return System(engines, load_tokenizer(target.tokenizer_path, target.cfg.vocab_size), capacity,
                  d.draft_len, tuple(target.cfg.eos_token_ids), spec.deployment.dtype,
                  setup=setup, oracle=oracle, draft_reference=draft_model)


def from_build(build_dir: Path, module=None) -> System:
    """The system of a build; ``module``: its `CompiledModule` loaded already (a benchmark's that times the
    build's calls, say)."""
    from specpilot.core.config import ModelConfig
    from specpilot.runtime.engine import CompiledModule

    module = CompiledModule(build_dir) if module is None else module
    m = module.manifest
    dtype, capacity, d = DTYPES[m.dtype], m.capacity, m.drafter
    device = "cuda" if m.target_kind == "cuda" and torch.cuda.is_available() else "cpu"  # stock beside it
    cfgs = {which: ModelConfig.from_dict(m.models[which]) for which in m.models}
    features = tuple(m.features) if m.features else None
    refs = {which: Deferred(lambda which=which: ReferenceModel(cfgs[which], module.reference_weights(which), dtype,
                                                               device, feature_layers=features if which == "target"
                                                               else None)) for which in m.models}
    compiled = {which: module.model(which) for which in m.models}
    conditioned = module.conditioned_spec() is not None     # a block / feature network, or a replay's block cost
    cost_kind = "block" if conditioned and d.kind == "replay" else "model"
    if conditioned:   # one network drafts for both engines (it reads the target's embeddings)
        net_cfg, tensors, directory = module.feature_drafter()
        refs["drafter"] = Deferred(lambda: build_net(net_cfg, tensors, module.reference_weights("target"), dtype, device))
        compiled["drafter"] = Deferred(module.draft_net)
    setup = DrafterSetup(d.kind, d.top_k, capacity, d.max_ngram, d.min_ngram, d.temperature, d.replay, cost_kind)
    oracle, vocab = Oracle(), cfgs["target"].vocab_size
    ref_make = setup.factory(refs.get("drafter"), oracle, vocab)
    cmp_make = setup.factory(compiled.get("drafter"), oracle, vocab)
    engines = Engines({"stock": Engine(refs["target"]), "stock-spec": Engine(refs["target"], ref_make),
                       "compiled": Engine(compiled["target"]), "compiled-spec": Engine(compiled["target"], cmp_make)})
    budget = m.tree_budget
    host = None if m.target_kind == "cuda" else 1     # a CPU build's cores go to its kernels (`runtime.threads`)
    if budget:
        engines["stock-tree"] = Engine(refs["target"], ref_make, budget)
        engines["compiled-tree"] = Engine(compiled["target"], cmp_make, budget)
        if m.two_level:
            engines["compiled-two-level"] = Engine(compiled["target"], cmp_make, budget, two_level=True)
        batch = batch_schedule(m)
        if batch is not None:
            engines["stock-tree-sched"] = Engine(refs["target"], ref_make, budget, batch=batch)
            engines["compiled-tree-sched"] = Engine(compiled["target"], cmp_make, budget, batch=batch)
    for name, engine in engines.items():
        if name.startswith("compiled"):
            engine.host_threads = host
    if dtype != torch.float32:
        engines.later("stock-fp32", lambda: Engine(ReferenceModel(cfgs["target"], module.reference_weights("target"),
                                                                  torch.float32, device, weight_format="stored")))
    tok = Path(build_dir) / m.tokenizer if m.tokenizer else None
    cfg = cfgs["target"]
    system = System(engines, load_tokenizer(tok, cfg.vocab_size), capacity, m.serving.draft_len,
                    tuple(cfg.eos_token_ids), m.dtype, m.serving.draft_min, m.serving.draft_dynamic,
                    m.serving.draft_step, setup=setup, oracle=oracle, draft_reference=refs.get("drafter"),
                    node_budget=m.node_budget.nodes if m.node_budget else None, draft_priced=m.serving.draft_priced)
    if conditioned:     # which drafter ran: the build's own or a retrained one
        from specpilot.core.weights import file_digest
        weights = directory / "model.safetensors"
        system.drafter_source = {"directory": str(directory), "sha256": file_digest(weights)} if weights.is_file() \
            else {"directory": str(directory), "seed": module.conditioned_spec()["init"]["seed"]}
    return system


def batch_schedule(m) -> BatchSchedule | None:
    """A build's batch mechanisms (None: it chose none; its tree engine then shares nothing)."""
    s = m.serving
    if not m.tree_budget or (m.node_budget is None and m.admission is None and s.draft_nodes is None):
        return None
    nodes = s.draft_nodes or m.tree_budget
    dynamic = lengths(nodes, s.draft_min, s.draft_step) if s.draft_dynamic else None
    budget = m.node_budget.nodes if m.node_budget else nodes * m.max_batch
    a = m.admission
    return BatchSchedule(nodes, budget, m.node_budget.min_prob if m.node_budget else 0.0, dynamic,
                         a.chunk if a else None, a.passes if a else BatchPolicy.passes)


def load_system(spec_or_build: str | Path) -> System:
    path = Path(spec_or_build)
    if path.is_dir():
        return from_build(path)
    from specpilot.core.spec import load_spec
    return from_spec(load_spec(path))
