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


def test_the_one_pass_bitmap_lookup_equals_unique_then_dropping_the_padding():
    """``bitmap_lookup`` (the prefetching loader's lookups of small tables) gives what ``torch.unique`` then
    ``drop_padding`` give, with and without a padding id present, and the bitmap of the ids kept."""
    from shardps.worker.embedding.modules import bitmap_lookup, drop_padding, unique_ids

    g = torch.Generator().manual_seed(3)
    cases = [(torch.randint(0, n, (k,), generator=g), n, pad)
             for n in (1, 7, 20, 2775) for k in (0, 1, 50, 4096) for pad in (None, 0, 3 % n, n - 1)]
    cases.append((torch.tensor([4, 4, 4]), 5, 4))  # nothing but padding
    for ids, n, pad in cases:
        seen, unique, inverse, local_pad = bitmap_lookup(ids, n, pad)
        want = drop_padding(*torch.unique(ids, return_inverse=True), pad)
        assert torch.equal(unique, want[0]) and unique.dtype == torch.int64
        assert torch.equal(inverse, want[1]) and inverse.dtype == torch.int64
        assert local_pad == want[2]
        assert torch.equal(seen.nonzero().reshape(-1), unique)
        assert [t.tolist() for t in unique_ids(ids, n)] == [t.tolist() for t in torch.unique(ids, return_inverse=True)]
