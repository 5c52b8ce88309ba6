"""``ShardedEmbeddingBagCollection`` refuses what it cannot look up, before any pull, naming what to fix."""

import pytest
import torch

from shardps.worker import ShardedEmbedding, ShardedEmbeddingBag, ShardedEmbeddingBagCollection


def test_bad_bags_and_features_are_refused_before_any_pull():
    with pytest.raises(TypeError, match="bag 'e' is a ShardedEmbedding"):
        ShardedEmbeddingBagCollection({"e": ShardedEmbedding(None, 4)})
    coll = ShardedEmbeddingBagCollection({"a": ShardedEmbeddingBag(None, 4)})
    ids = torch.tensor([[1, 2]])
    with pytest.raises(KeyError, match="no bag for feature 'b'"):
        coll({"b": ids})
    with pytest.raises(TypeError, match="feature 'a' takes ids.*got tuple of 4"):
        coll({"a": (ids, None, None, None)})
    with pytest.raises(TypeError, match="feature 'a' takes ids.*got int"):
        coll({"a": 7})
    # well-formed input reaches the bag, which is not attached to a DistributedOptimizer yet
    with pytest.raises(RuntimeError, match="not attached to shards yet"):
        coll({"a": ids})
    assert coll({}) == {}
