"""The LLM proposer: an OpenAI-compatible chat endpoint proposes candidate pipelines.

It is given the cost report (factors, bottleneck, replayed tree acceptance, the slowest
kernels against their bounds), the current pipeline, the passes with their options and
relations, and the verified memory entries; it must answer with one JSON object:

    {"candidates": [{"pipeline": "<pipeline text>", "direction": "acceptance|kernel|overhead",
                     "estimated_gain": 0.1, "rationale": "..."}]}

The answer is data: validated with pydantic, each pipeline parsed by the pipeline grammar and
checked by the legality solver; anything else is dropped with the reason.  Nothing it says
is executed.  Endpoint: ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (or arguments); timeouts and
retries are the client's; an unreachable endpoint or an answer that is not the schema after
the retries is a clear error.
"""

from __future__ import annotations

import json
import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpilot.agent.proposers import Candidate
from specpilot.core.errors import SpecPilotError
from specpilot.passes.legality import check
from specpilot.passes.pipeline import parse
from specpilot.passes.registry import REGISTRY


class _Proposal(BaseModel):
    model_config = ConfigDict(extra="ignore")
    pipeline: str = Field(max_length=500)
    direction: str = "acceptance"
    estimated_gain: float = Field(ge=-1.0, le=100.0)
    rationale: str = Field(default="", max_length=2000)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")
    candidates: list[dict] = Field(max_length=16)     # each checked on its own: one bad one drops only itself


SYSTEM = ("You are the proposer of SpecPilot, a compiler for lossless speculative decoding. Given a cost report, "
          "propose pass pipelines (the grammar: comma-separated pass names, options in braces, e.g. "
          "'tree-verify{budget=32},gdn-path-recompute') that attack the largest factor. Answer with one JSON object "
          "{\"candidates\": [{\"pipeline\": str, \"direction\": str, \"estimated_gain\": float, \"rationale\": str}]} "
          "and nothing else.")


def _passes_table() -> list[dict]:
    return [{"name": c.name, "doc": c.doc, "options": {o.name: {"type": o.type.__name__, "default": o.default,
                                                              **({"choices": list(o.choices)} if o.choices else {})}
                                                     for o in c.options},
             "requires": list(c.requires), "conflicts": list(c.conflicts)}
            for c in REGISTRY.values() if c.proposable]


class LLMProposer:
    name = "llm"

    def __init__(self, model: str | None = None, base_url: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0, retries: int = 2, memory_entries=()):
        self.model = model or os.environ.get("SPECPILOT_LLM_MODEL")
        if not self.model:
            raise SpecPilotError("the llm proposer needs a model name: --llm-model NAME (or SPECPILOT_LLM_MODEL)")
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if not self.base_url:
            raise SpecPilotError("the llm proposer needs an endpoint: set OPENAI_BASE_URL (any OpenAI-compatible server)")
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "none"
        self.timeout, self.retries = timeout, retries
        self.memory_entries = list(memory_entries)
        self.rejected: list[str] = []       # what was dropped from the last answer, and why

    def _ask(self, prompt: str) -> str:
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout,
                               max_retries=self.retries)
        last = None
        for _attempt in range(self.retries + 1):
            try:
                reply = client.chat.completions.create(
                    model=self.model, temperature=0.2, response_format={"type": "json_object"},
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])
            except openai.APIConnectionError as e:
                raise SpecPilotError(f"LLM endpoint {self.base_url} unreachable: {e}") from None
            except openai.APIStatusError as e:
                raise SpecPilotError(f"LLM endpoint {self.base_url} answered HTTP {e.status_code}: "
                                     f"{str(e.message)[:200]}") from None
            except openai.APITimeoutError:
                raise SpecPilotError(f"LLM endpoint {self.base_url} timed out after {self.timeout:.0f} s") from None
            except (openai.APIError, ValueError) as e:     # a 200 whose body is not JSON / a chat completion
                raise SpecPilotError(f"LLM endpoint {self.base_url} answered garbage: {str(e)[:200]}") from None
            text = (reply.choices[0].message.content or "") if reply.choices else ""
            try:
                return _Answer.model_validate(json.loads(text))
            except (json.JSONDecodeError, ValidationError) as e:
                last = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        raise SpecPilotError(f"LLM endpoint {self.base_url} did not answer in the schema after "
                             f"{self.retries + 1} tries ({last})")

    def propose(self, report: dict, current, context, draft_len: int, references, tried: set[str]) -> list[Candidate]:
        brief = {k: report[k] for k in ("pipeline", "engine", "target", "factors", "bottleneck", "tree_acceptance",
                                        "accepted_per_verification", "wall_seconds", "kernel_seconds") if k in report}
        brief["slowest_kernels"] = [{k: row[k] for k in ("name", "calls", "seconds", "bound_seconds", "ratio")}
                                    for row in report.get("kernels", [])[:8]]
        prompt = json.dumps({"current_pipeline": str(current), "draft_len": draft_len,
                             "deployment": {"target_kind": context.target_kind, "arch": context.arch,
                                            "hybrid": context.hybrid, "dtype": context.dtype},
                             "cost_report": brief, "passes": _passes_table(),
                             "memory": [{"pipeline": e.pipeline, "results": e.results} for e in self.memory_entries],
                             "already_tried": sorted(tried)})
        answer = self._ask(prompt)
        out, self.rejected = [], []
        for raw in answer.candidates:
            try:
                p = _Proposal.model_validate(raw)
            except ValidationError as e:
                self.rejected.append(f"{str(raw)[:120]}: {e.errors()[0]['msg']}")
                continue
            try:
                pipeline = parse(p.pipeline)
            except SpecPilotError as e:
                self.rejected.append(f"{p.pipeline!r}: {e}")
                continue
            if any(not REGISTRY[x.name].proposable for x in pipeline):
                self.rejected.append(f"{p.pipeline!r}: uses a test-only pass")
                continue
            reasons = check(pipeline, context)
            if reasons:
                self.rejected.append(f"{p.pipeline!r}: illegal ({'; '.join(reasons)})")
                continue
            text = str(pipeline)
            if text in tried or text == str(current):
                continue
            direction = p.direction if p.direction in ("acceptance", "kernel", "overhead") else "acceptance"
            out.append(Candidate(text, direction, text, p.estimated_gain, p.rationale[:300], "llm"))
        return out
