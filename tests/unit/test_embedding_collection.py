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


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bags_of_one_id_are_a_gather_equal_to_embedding_bag(mode):
    """``[B, 1]`` bags take the gather path: the same output bit for bit, the same gradient (summed per row
    in sample order) within float32 rounding; other shapes are embedding_bag's."""
    import torch.nn.functional as F

    from shardps.worker.embedding.modules import bags

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(50, 8, generator=g)
    index = torch.randint(0, 50, (300, 1), generator=g)  # many repeats
    up = torch.randn(300, 8, generator=g)
    got_w, ref_w = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    got = bags(index, got_w, None, mode, None, False, None)
    ref = F.embedding_bag(index, ref_w, mode=mode)
    assert got.grad_fn.name() == "IndexSelectBackward0"
    assert torch.equal(got, ref)
    got.backward(up)
    ref.backward(up)
    assert torch.allclose(got_w.grad, ref_w.grad, rtol=0, atol=1e-5)
    # two ids a bag, weights, a padding id: embedding_bag itself
    two = torch.randint(0, 50, (30, 2), generator=g)
    assert torch.equal(bags(two, weight, None, mode, None, False, None), F.embedding_bag(two, weight, mode=mode))
    padded = bags(index, weight, None, mode, None, False, 3)
    assert torch.equal(padded, F.embedding_bag(index, weight, mode=mode, padding_idx=3))
