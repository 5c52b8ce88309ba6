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


def test_the_batched_unique_equals_torch_unique_for_every_feature():
    from shardps.worker.embedding.collection import unique_rows

    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(-5, 5, (12,), generator=g) for _ in range(5)]  # one batch of five, many repeats
    ids += [torch.randint(0, 100, (3, 4), generator=g), torch.randint(-2**62, 2**62, (7,), generator=g),
            torch.empty(0, dtype=torch.int64)]
    for t, (unique, inverse) in zip(ids, unique_rows(ids)):
        want_unique, want_inverse = torch.unique(t.reshape(-1), return_inverse=True)
        assert torch.equal(unique, want_unique) and torch.equal(inverse, want_inverse)
        assert inverse.dtype == want_inverse.dtype
