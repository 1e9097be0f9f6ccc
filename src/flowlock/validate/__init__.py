"""Validation suites: the conditioning-chain replay, the first-divergence trace and the RL
rollout/replay consistency run.

Each suite returns a JSON-able dict; ``flowlock check`` runs them and fails on any violation.
"""
