"""`pd-gateway verify`: a rollout gate run against a live deployment. A fixed, seeded suite goes through the gateway
and, request for request, to a co-located baseline engine; each answer is judged by greedy equality where the
engines are deterministic, else by the first token's top-k logprob distance against the baseline's own noise
floor (`distance.py`); negative controls driven straight at P and D read wrong KV on purpose and must be flagged,
which proves the measure can see a wrong answer. Modules: `distance` (the measure, pure), `suite` (the cases),
`judge` (one verdict per case, pure), `controls` (the handles read wrongly on purpose), `http` (the wire),
`run` (the whole run), `report` (table, verdict line, JSON), `command` (the CLI).

Kept light to import: `bench/gpu` uses `distance` on a host without the gateway's other dependencies."""
