"""Reduction within a node: the local ranks of one node act as one member of the job (``NodeOptimizer``)."""

from __future__ import annotations

__all__ = ["NodeOptimizer"]


def __getattr__(name: str):
    if name == "NodeOptimizer":
        from shardps.worker.node.optimizer import NodeOptimizer

        return NodeOptimizer
    raise AttributeError(f"module 'shardps.worker.node' has no attribute {name!r}")
