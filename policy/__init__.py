"""Policies: proposers of IR edits for the search (l2ir.search.loop).

    base.py          the protocol: Context in, Proposals (edits or a kernel, with a note) out, Feedback (reward,
                     verdict illegal | failed | measured) back; state_dict/load_state_dict for the records DB; the
                     registry (get_policy("random" | "rules" | "learned" | "llm" | "module:Factory" | an object))
    actions.py       the edit operators: a flat list of frozen (knob, value) records over the whole IR and every
                     backend, their fix-ups, and the edits that express a child as a difference from its parent
    random_edits.py  random legal edits (the baseline)
    rules.py         expert rules: tiles by waves, split-K / stream-K, ping-pong vs cooperative, clusters, the sm80
                     rule for tiny shapes; ranked, each with its reason
    learned.py       REINFORCE over the edit operators, conditioned on problem and kernel features, with a
                     cost-model head that ranks draws before they are compiled (torch, CPU)
    features.py      the problem and kernel features the learned policy reads
    llm.py           any chat model proposes edits, whole kernels or free-form CUDA (a Source node), parsed back
                     with the grammar, checked, repaired from the verifier's errors; model calls in the records DB
    prompts.py       the LLM prompt: problem, kernel, measurements and roofline share, relatives, node grammar
    model_backends.py  an OpenAI-compatible endpoint (openai client) or a local transformers model (offline)
    episodes.py      a greedy driver that counts evaluations to a speedup (training and comparisons)

examples/my_policy.py is a complete custom policy; bench/policy_compare.py compares learned and random edits on
shapes the learned policy never saw.
"""
