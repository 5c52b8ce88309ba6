"""Table optimizers a ported model brings (Adam, AdamW, weight decay) and row initialisers, against torch.

One worker and two real shard processes train a ``ShardedEmbeddingBag``
(sum) and a ``ShardedEmbedding`` (with ``padding_idx``) for 8 steps; the
oracle is torch's own optimizer class, stepped in one process on exactly
the rows each step touches (gathered into a parameter of their own, with
their saved state), which is what "weight decay on the touched rows only,
lazy Adam" means: an untouched row keeps its value and state. Every row must
match within 1e-6. Rows start from the initialiser each table names, the
same values ``TableSpec.initial_rows`` gives (placement-free).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardps.common.rows import TableSpec
from shardps.worker import DistributedOptimizer, ShardedEmbedding, ShardedEmbeddingBag
from tests.support.forked import ForkedCluster

N, DIM, STEPS = 40, 4, 8
OPTIMIZERS = {
    "sgd_wd": (torch.optim.SGD, {"lr": 0.3, "weight_decay": 0.1}),
    "adagrad_wd": (torch.optim.Adagrad, {"lr": 0.3, "weight_decay": 0.05, "initial_accumulator_value": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95)}),
    "adam_wd": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.2}),
}
INITS = {"bag": ("normal", 0.0, 0.5), "emb": ("uniform", -0.2, 0.3)}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = ShardedEmbeddingBag(N, DIM, mode="sum", init=INITS["bag"])
        self.emb = ShardedEmbedding(N, DIM, padding_idx=0, init=INITS["emb"])

    def forward(self, b: dict) -> torch.Tensor:
        return (self.bag(b["ids"], b["offsets"]) * self.emb(b["seq"]).sum(1)).sum(1)


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, 20, (4, 3), generator=g)  # ids 20..39 of emb are never touched
    seq[0, 0] = 0
    return {"ids": torch.randint(0, 30, (10,), generator=g), "offsets": torch.tensor([0, 2, 5, 8]), "seq": seq,
            "y": torch.randn(4, generator=g)}


def spec(name: str) -> TableSpec:
    kind, *args = INITS[name]
    return TableSpec(name=name, embedding_dim=DIM, num_embeddings=N, padding_idx=0 if name == "emb" else -1,
                     init=kind, init_args=tuple(args))


def oracle(cls, kw: dict) -> dict[str, torch.Tensor]:
    """torch's ``cls`` stepped on the rows each step touches, each row's state kept between its steps."""
    weights = {name: spec(name).initial_rows(torch.arange(N)) for name in INITS}
    states: dict[str, dict[int, dict]] = {name: {} for name in INITS}
    steps = dict.fromkeys(INITS, 0)
    for step in range(STEPS):
        b = batch(step)
        leaves = {name: w.clone().requires_grad_(True) for name, w in weights.items()}
        bag = nn.functional.embedding_bag(b["ids"], leaves["bag"], b["offsets"], mode="sum")
        emb = nn.functional.embedding(b["seq"], leaves["emb"], padding_idx=0).sum(1)
        nn.functional.mse_loss((bag * emb).sum(1), b["y"]).backward()
        for name, leaf in leaves.items():
            touched = (leaf.grad.abs().sum(1) > 0) | torch.isin(torch.arange(N), b["ids" if name == "bag" else "seq"])
            if name == "emb":
                touched[0] = False  # the padding row is never trained
            rows = touched.nonzero().reshape(-1)
            steps[name] += 1
            for r in rows.tolist():
                p = nn.Parameter(weights[name][r].clone())
                p.grad = leaf.grad[r].clone()
                opt = cls([p], **kw)
                if r in states[name]:
                    opt.state[p] = states[name][r]
                elif issubclass(cls, torch.optim.Adam):  # a row's moments start at zero when it is first touched
                    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(DIM),
                                    "exp_avg_sq": torch.zeros(DIM)}
                if "step" in opt.state[p]:  # the bias corrections count the table's steps (as torch's sparse ones)
                    opt.state[p]["step"] = torch.tensor(float(steps[name] - 1))
                opt.step()
                states[name][r] = opt.state[p]
                weights[name][r] = p.detach()
    return weights


def train(servers: str, cls, kw: dict) -> dict[str, torch.Tensor]:
    model = Net()
    head = nn.Linear(1, 1)
    dist = DistributedOptimizer(torch.optim.SGD(head.parameters(), lr=0.0), head.named_parameters(),
                                servers=servers, model=model, sparse_optimizer=cls([model.bag.handle,
                                                                                    model.emb.handle], **kw))
    try:
        for step in range(STEPS):
            b = batch(step)
            dist.zero_grad()
            (nn.functional.mse_loss(model(b), b["y"]) + 0 * head(torch.ones(1, 1)).sum()).backward()
            dist.step()
        state = model.state_dict()
        return {name: state[f"{name}.weight"] for name in INITS}
    finally:
        dist.close()


@pytest.fixture(scope="module")
def shards():
    with ForkedCluster(2) as cluster:
        yield cluster


def reset(cluster: ForkedCluster) -> None:
    cluster.reset()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_table_optimizers_equal_torch_on_the_touched_rows(shards, name):
    reset(shards)
    cls, kw = OPTIMIZERS[name]
    got, want = train(shards.servers, cls, kw), oracle(cls, kw)
    for table in INITS:
        assert torch.allclose(got[table], want[table], atol=1e-6, rtol=0), (table, (got[table] - want[table]).abs().max())
        untouched = torch.arange(20, N) if table == "emb" else torch.arange(30, N)
        assert torch.equal(got[table][untouched], spec(table).initial_rows(untouched)), "an untouched row moved"


@pytest.mark.parametrize("init", ["zeros", ("constant", 0.25), ("uniform", -1.0, 3.0), ("normal", 2.0, 0.5), None])
def test_rows_start_from_their_initialiser_on_every_shard(shards, init):
    reset(shards)
    table = ShardedEmbedding(None, 8, name="t", init=init)
    head = nn.Linear(1, 1)
    dist = DistributedOptimizer(torch.optim.SGD(head.parameters(), lr=0.0), head.named_parameters(),
                                servers=shards.servers, sparse_optimizer=torch.optim.SGD([table.handle], lr=0.1))
    try:
        ids = torch.arange(-2000, 2000) * 7919
        got = table(ids).detach()
    finally:
        dist.close()
    assert torch.equal(got, table.spec().initial_rows(ids))  # the shards drew what the spec says, bit for bit
    if init == "zeros":
        assert not got.any()
    elif init is None:
        assert got.abs().max() <= 1 / 8 ** 0.5
    elif init[0] == "constant":
        assert bool((got == 0.25).all())
    elif init[0] == "uniform":
        assert got.min() >= -1.0 and got.max() < 3.0 and abs(got.mean().item() - 1.0) < 0.05
    else:
        assert abs(got.mean().item() - 2.0) < 0.02 and abs(got.std().item() - 0.5) < 0.02


def test_settings_a_table_cannot_honour_are_refused_naming_them():
    p = [ShardedEmbedding(None, 4, name="t").handle]
    from shardps.worker.embedding.specs import group_spec as _group_spec
    with pytest.raises(ValueError, match="amsgrad"):
        _group_spec(torch.optim.Adam(p, amsgrad=True), torch.optim.Adam(p, amsgrad=True).param_groups[0])
    with pytest.raises(ValueError, match="momentum"):
        opt = torch.optim.SGD(p, lr=0.1, momentum=0.9)
        _group_spec(opt, opt.param_groups[0])
    with pytest.raises(ValueError, match="maximize"):
        opt = torch.optim.Adagrad(p, maximize=True)
        _group_spec(opt, opt.param_groups[0])
    with pytest.raises(ValueError, match="RMSprop"):
        opt = torch.optim.RMSprop(p)
        _group_spec(opt, opt.param_groups[0])
    with pytest.raises(ValueError, match="init must be"):
        ShardedEmbedding(None, 4, init=("normal", 0.0))
    with pytest.raises(ValueError, match="std >= 0"):
        ShardedEmbedding(None, 4, init=("normal", 0.0, -1.0))
