"""Validation suites: the conditioning-chain replay and the first-divergence trace.

Each suite returns a JSON-able dict; ``flowlock check`` runs them and fails on any violation.
"""
