"""Policies that propose IR edits (rules, a learned policy, an LLM). Not written yet: the protocol is
`propose(context) -> edits` and `update(feedback)` (see DESIGN.md)."""
