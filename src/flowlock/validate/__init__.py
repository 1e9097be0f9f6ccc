"""Validation and reports: the conditioning-chain replay, the first-divergence trace, the RL
rollout/replay consistency run, layout checks, the demo, and the report style every command uses
(:mod:`flowlock.validate.report`).

Each run returns a JSON-able dict; ``flowlock check`` runs the suites of
:mod:`flowlock.validate.suites` and fails on any violation.
"""
