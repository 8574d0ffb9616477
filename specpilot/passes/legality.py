"""Pipeline legality, solved with z3: requires / conflicts / order / target constraints.

Each pass of a candidate set gets a Boolean "present" and an integer position.  The rules:

    requires     present(p) -> present(q) and pos(q) < pos(p)
    conflicts    not (present(p) and present(q))
    after        present(p) and present(q) -> pos(q) < pos(p)
    target       present(p) -> the target kind is one of p.targets
    legality     present(p) -> p.legal(context) was ok
    relations    present(p) and present(q) -> p's rule on its and q's options holds

`check` fixes presence and positions to the given pipeline and, if that is unsatisfiable,
returns the violated rules in words (z3's unsat core over named assertions).  `orderings`
enumerates every legal order of a set of passes (the search uses that) as the topological orders
of the passes' precedence graph (networkx).
"""

from __future__ import annotations

import itertools

import networkx as nx
import z3

from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import Pass, PassContext
from specpilot.passes.pipeline import Pipeline


def _rules(passes: list[Pass], context: PassContext, present: dict, pos: dict) -> list[tuple[str, z3.BoolRef]]:
    names = {p.name for p in passes}
    rules = []
    for p in passes:
        for q in p.requires:
            if q in names:
                rules.append((f"{p.name} requires {q} earlier in the pipeline",
                              z3.Implies(present[p.name], z3.And(present[q], pos[q] < pos[p.name]))))
            else:
                rules.append((f"{p.name} requires {q}, which is not in the pipeline", z3.Not(present[p.name])))
        for flag, q in p.needs_when:
            if getattr(context, flag):
                if q in names:
                    rules.append((f"{p.name} needs {q} here ({flag} target)", z3.Implies(present[p.name], present[q])))
                else:
                    rules.append((f"{p.name} needs {q} on a {flag} target, and it is not in the pipeline",
                                  z3.Not(present[p.name])))
        for q in p.conflicts:
            if q in names:
                rules.append((f"{p.name} conflicts with {q}", z3.Not(z3.And(present[p.name], present[q]))))
        for q in p.after:
            if q in names:
                rules.append((f"{p.name} must come after {q}",
                              z3.Implies(z3.And(present[p.name], present[q]), pos[q] < pos[p.name])))
        if context.target_kind not in p.targets:
            rules.append((f"{p.name} is not available for target {context.target_kind} "
                          f"(only {', '.join(p.targets)})", z3.Not(present[p.name])))
        ok, reason = p.legal(context)
        if not ok:
            rules.append((f"{p.name}: {reason}", z3.Not(present[p.name])))
        by_name = {q.name: q for q in passes if q is not p}
        for q, words, holds in p.relations(by_name):
            rules.append((words, z3.Implies(z3.And(present[p.name], present[q]), z3.BoolVal(holds))))
    return rules


def check(pipeline: Pipeline, context: PassContext) -> list[str]:
    """The violated rules, in words; empty when the pipeline is legal."""
    passes = list(pipeline)
    counts = {}
    for p in passes:
        counts[p.name] = counts.get(p.name, 0) + 1
    repeated = [f"{name} appears {n} times; a pass may appear once" for name, n in counts.items() if n > 1]
    if repeated:
        return repeated
    present = {p.name: z3.Bool(f"present_{p.name}") for p in passes}
    pos = {p.name: z3.Int(f"pos_{p.name}") for p in passes}
    facts = [f for i, p in enumerate(passes) for f in (present[p.name], pos[p.name] == i)]  # the pipeline as given
    rules = _rules(passes, context, present, pos)
    violated: set[str] = set()
    while True:   # one unsat core at a time, until what is left is satisfiable: every violation, not one
        solver = z3.Solver()
        solver.add(*facts)
        labels = {}
        for k, (words, rule) in enumerate(rules):
            label = z3.Bool(f"rule_{k}")
            labels[str(label)] = words
            solver.assert_and_track(rule, label)
        if solver.check() == z3.sat:
            return sorted(violated)
        core = {labels[str(label)] for label in solver.unsat_core()}
        violated |= core
        rules = [(words, rule) for words, rule in rules if words not in core]


def require_legal(pipeline: Pipeline, context: PassContext) -> None:
    reasons = check(pipeline, context)
    if reasons:
        raise SpecPilotError(f"illegal pipeline {str(pipeline)!r}: " + "; ".join(reasons))


def precedence(passes: list[Pass]) -> nx.DiGraph:
    """The ordering rules among ``passes`` as a graph: an edge q -> p where p requires q or must come
    after it."""
    graph = nx.DiGraph()
    graph.add_nodes_from(p.name for p in passes)
    for p in passes:
        for q in (*p.requires, *p.after):
            if q in graph:
                graph.add_edge(q, p.name)
    return graph


def orderings(passes: list[Pass], context: PassContext, limit: int = 1000) -> list[Pipeline]:
    """Every legal ordering of all of ``passes`` (at most ``limit``), in a deterministic order: the
    topological orders of `precedence`, when the order-free rules hold (they hold for all or none)."""
    by_name = {p.name: p for p in passes}
    try:
        orders = list(itertools.islice(nx.all_topological_sorts(precedence(passes)), limit))
    except nx.NetworkXUnfeasible:     # a cycle of requires / after: no order
        return []
    if not orders or check(Pipeline([by_name[n] for n in orders[0]]), context):
        return []
    return sorted((Pipeline([by_name[n] for n in order]) for order in orders), key=str)
