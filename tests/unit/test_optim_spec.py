import json

import pytest
import torch

from shardps.common.optim import OptimizerSpecError, build_optimizer, check_shardable, optimizer_spec


def test_spec_carries_class_and_group_hyperparameters() -> None:
    w, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=0.01, betas=(0.8, 0.9))
    spec = optimizer_spec(opt)
    assert spec.class_name == "AdamW"
    groups = [json.loads(g) for g in spec.group_hyperparams_json]
    assert groups[0]["betas"] == [0.8, 0.9] and groups[1]["weight_decay"] == 0.0
    assert "params" not in groups[0] and "foreach" not in groups[0]
    flat = [(0, torch.zeros(3)), (1, torch.zeros(2))]
    shard_opt = build_optimizer(spec, flat)
    assert type(shard_opt) is torch.optim.AdamW
    assert shard_opt.param_groups[0]["betas"] == (0.8, 0.9) and shard_opt.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.Adadelta, torch.optim.NAdam])
def test_non_shardable_optimizers_are_rejected(cls) -> None:
    opt = cls([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(OptimizerSpecError, match="element-wise"):
        optimizer_spec(opt)
    with pytest.raises(OptimizerSpecError, match="LAMB"):
        check_shardable("LAMB")
