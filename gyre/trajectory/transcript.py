"""An execution's transcript, read back from its trajectory tree: what a scoring rule may see.

A task whose python rule asks for it (`scoring: {rule: python, transcript: true}`,
docs/tasks.md "Rewards from the transcript") gets, beside the workspace, the messages of
the execution's final main-agent call and that call's answer, as JSON data:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...],
     "final_answer": str,   # the last assistant text: what the policy sampled last
     "calls": int}          # model calls the execution made (the tree's nodes)

It is decoded from the recorded tokens, so it is exactly what the policy saw and wrote, not
what a harness says it sent: the path through the last call whose role is `main` (the last
call at all when none is), cut into one message per run of tokens of one author
(`Provenance`); chat-template markup separates messages and is dropped. Harness-supplied
assistant text (INJECTED) reads as assistant, evaluator feedback (EVALUATOR) as user.
Pure: the caller passes the tokenizer's decode, so the proxy node (which holds the
tokenizer) builds it and the evaluator only forwards it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gyre.trajectory.tree import Provenance, TrajectoryTree

ROLE_OF = {
    Provenance.POLICY: "assistant",
    Provenance.SYSTEM: "system",
    Provenance.USER: "user",
    Provenance.TOOL: "tool",
    Provenance.INJECTED: "assistant",
    Provenance.EVALUATOR: "user",
}
"""The message role of each author's tokens (TEMPLATE markup belongs to no message)."""

Decode = Callable[[Sequence[int]], str]
"""Token ids -> text, special tokens dropped (the tokenizer's decode)."""


def final_call(tree: TrajectoryTree) -> int | None:
    """The node whose answer ends the execution: the last call of role `main` (the last call
    where there is none); None for an execution that made no call."""
    nodes = tree.nodes
    main = [n.node_id for n in nodes if n.role == "main"]
    if main:
        return main[-1]
    return nodes[-1].node_id if nodes else None


def runs(ids: np.ndarray, provenance: np.ndarray, owner: np.ndarray) -> list[tuple[int, list[int]]]:
    """(provenance, ids) of each maximal run of one author's tokens within one call's input
    or output, in order; TEMPLATE tokens end a run and belong to none."""
    out: list[tuple[int, list[int]]] = []
    key: tuple[int, int] | None = None
    for tok, prov, node in zip(ids.tolist(), provenance.tolist(), owner.tolist(), strict=True):
        if prov == Provenance.TEMPLATE:
            key = None
            continue
        if (prov, node) != key:
            out.append((prov, []))
            key = (prov, node)
        out[-1][1].append(tok)
    return out


def transcript(tree: TrajectoryTree, decode: Decode) -> dict[str, Any]:
    """The execution's transcript (see the module docstring), JSON-serialisable."""
    nid = final_call(tree)
    if nid is None:
        return {"messages": [], "final_answer": "", "calls": 0}
    path = tree.materialize(nid)
    messages = []
    for prov, ids in runs(path.ids, path.provenance, path.node_of_token):
        text = decode(ids).strip()
        if text:
            messages.append({"role": ROLE_OF[Provenance(prov)], "content": text})
    final = decode(tree.node(nid).output_ids.tolist()).strip()
    return {"messages": messages, "final_answer": final, "calls": len(tree)}
