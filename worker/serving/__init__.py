"""Serving replicas: read-only copies of a job's tables and dense parameters, kept fresh by touched-row deltas."""
