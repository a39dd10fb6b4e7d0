"""The turn, from a client's request to its recorded outcome: `intake/` makes the request a TurnRequest,
`reuse/` decides what the turn reuses, `legs/` talks to the engines, `state/` keeps the conversation in the
store, `run/` runs the legs as the transfer protocol says; the flat modules run one turn through them
(runner.py) and act for the admin API (admin_actions.py). Sub-packages import only those before them in
that list (tests/unit/test_layering.py)."""
