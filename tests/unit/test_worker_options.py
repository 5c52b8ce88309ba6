"""The option groups of DistributedOptimizer (``shardps.worker.config``): defaults, checks, and the keywords that
moved into them. No shard is started: every error here is raised before any connection."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from prometheus_client import CollectorRegistry

from shardps.common.modes import MAX_STALENESS
from shardps.common.security import ChannelSecurity
from shardps.common.transport import DEFAULT_MAX_MESSAGE_BYTES
from shardps.worker.config import (MOVED_KEYWORDS, ConsistencyOptions, ObservabilityOptions, WireOptions,
                                   moved_keywords_error)
from shardps.worker.node.optimizer import FORWARDED_KEYWORDS, NodeOptimizer
from shardps.worker.optimizer import DistributedOptimizer

DEAD = "127.0.0.1:1"  # never reached: every call below fails before connecting


def wrap(**kwargs) -> DistributedOptimizer:
    model = torch.nn.Linear(3, 2)
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), **kwargs)


# ------------------------------------------------------------ ConsistencyOptions
def test_consistency_defaults_and_proto() -> None:
    sync = ConsistencyOptions()
    assert (sync.mode, sync.staleness, sync.scale_lr_by_staleness) == ("sync", None, False)
    assert sync.to_proto().mode == "sync" and sync.to_proto().staleness == 0
    ssp = ConsistencyOptions(mode="ssp", staleness=3, scale_lr_by_staleness=True).to_proto()
    assert (ssp.mode, ssp.staleness, ssp.scale_lr_by_staleness) == ("ssp", 3, True)
    assert ConsistencyOptions(mode="ssp", staleness=0).to_proto().staleness == 0
    assert ConsistencyOptions(mode="async", scale_lr_by_staleness=True).to_proto().mode == "async"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"mode": "ssp"}, "needs staleness"),
    ({"mode": "ssp", "staleness": -1}, "needs staleness"),
    ({"mode": "ssp", "staleness": True}, "needs staleness"),
    ({"mode": "ssp", "staleness": 1.5}, "needs staleness"),
    ({"mode": "ssp", "staleness": MAX_STALENESS + 1}, "above the limit"),
    ({"mode": "async", "staleness": 2}, "only applies to mode='ssp'"),
    ({"mode": "hogwild"}, "mode must be one of 'sync', 'async', 'ssp'"),
    ({"scale_lr_by_staleness": True}, "sync rounds have no staleness"),
])
def test_consistency_checks(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConsistencyOptions(**kwargs)


def test_option_groups_are_frozen_and_keyword_only() -> None:
    for cls in (ConsistencyOptions, WireOptions, ObservabilityOptions):
        instance = cls()
        field = dataclasses.fields(cls)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(instance, field, getattr(instance, field))
        with pytest.raises(TypeError):
            cls(getattr(instance, field))  # positional
        assert cls.__doc__ and all(f.name in cls.__doc__ for f in dataclasses.fields(cls)), cls


# ------------------------------------------------------------ WireOptions
def test_wire_defaults() -> None:
    wire = WireOptions()
    assert wire.chunk_bytes == 1 << 20 and wire.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert (wire.push_dtype, wire.pull_dtype, wire.checksum) == ("fp32", "fp32", False)
    assert (wire.rpc_timeout, wire.connect_timeout, wire.retry_seconds, wire.security) == (120.0, 30.0, 60.0, None)
    assert WireOptions(retry_seconds=0).retry_seconds == 0  # no retries
    assert WireOptions(chunk_bytes=8 << 20, max_message_bytes=(8 << 20) + (64 << 10)).chunk_bytes == 8 << 20
    assert WireOptions(push_dtype="bf16", pull_dtype="fp16", security=ChannelSecurity(token="t0ken")).checksum is False
    assert WireOptions().retain_freed_memory is True  # shardps.common.memory


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"chunk_bytes": 8 << 20}, "does not fit in max_message_bytes .* lower chunk_bytes to at most 8323072"),
    ({"chunk_bytes": 1 << 20, "max_message_bytes": 1 << 20}, "does not fit in max_message_bytes"),
    ({"chunk_bytes": 18}, "multiple of 4"),
    ({"chunk_bytes": 8}, ">= 16"),
    ({"chunk_bytes": 1024.0}, "must be an int"),
    ({"chunk_bytes": True}, "must be an int"),
    ({"max_message_bytes": 0}, "max_message_bytes must be a positive int"),
    ({"push_dtype": "fp64"}, "push_dtype: wire dtype must be one of"),
    ({"pull_dtype": "int8"}, "pull_dtype: wire dtype must be one of"),
    ({"pull_dtype": ["fp32"]}, "pull_dtype: "),
    ({"checksum": "yes"}, "checksum must be True or False"),
    ({"retain_freed_memory": 1}, "retain_freed_memory must be True or False"),
    ({"rpc_timeout": 0}, "rpc_timeout is in seconds and must be a finite number > 0"),
    ({"rpc_timeout": math.inf}, "rpc_timeout is in seconds"),
    ({"connect_timeout": -1.0}, "connect_timeout is in seconds and must be a finite number > 0"),
    ({"connect_timeout": math.nan}, "connect_timeout"),
    ({"retry_seconds": -0.5}, "retry_seconds is in seconds and must be a finite number >= 0"),
    ({"retry_seconds": "60"}, "retry_seconds"),
    ({"security": "tls"}, "security must be a shardps.common.security.ChannelSecurity"),
    ({"push_credit_bytes": -1}, "push_credit_bytes must be an int >= 0"),
    ({"push_credit_bytes": 1.5}, "push_credit_bytes must be an int >= 0"),
    ({"push_credit_bytes": True}, "push_credit_bytes must be an int >= 0"),
])
def test_wire_checks(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WireOptions(**kwargs)


# ------------------------------------------------------------ ObservabilityOptions
def test_observability_defaults_and_values() -> None:
    obs = ObservabilityOptions()
    assert (obs.metrics_port, obs.metrics_host, obs.metrics_registry, obs.on_membership_change) == (
        None, "0.0.0.0", None, None)
    registry = CollectorRegistry()
    obs = ObservabilityOptions(metrics_port=0, metrics_host="127.0.0.1", metrics_registry=registry,
                               on_membership_change=print)
    assert obs.metrics_registry is registry and obs.on_membership_change is print
    assert ObservabilityOptions(metrics_port=65535).metrics_port == 65535


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"metrics_port": -1}, r"metrics_port must be an int in \[0, 65535\]"),
    ({"metrics_port": 65536}, "metrics_port must be an int"),
    ({"metrics_port": "9100"}, "metrics_port must be an int"),
    ({"metrics_host": ""}, "metrics_host must be a non-empty host"),
    ({"metrics_registry": object()}, "metrics_registry must be a prometheus_client.CollectorRegistry"),
    ({"on_membership_change": "log"}, "on_membership_change must be callable"),
])
def test_observability_checks(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ObservabilityOptions(**kwargs)


# ------------------------------------------------------------ DistributedOptimizer's signature
def test_distributed_optimizer_signature() -> None:
    params = inspect.signature(DistributedOptimizer).parameters
    assert list(params) == ["optimizer", "named_parameters", "servers", "worker_id", "model", "named_buffers",
                            "broadcast_buffers", "backward_passes_per_step", "max_grad_norm", "norm_type",
                            "grad_scaler", "push_during_backward", "consistency", "wire", "observability",
                            "sparse_optimizer", "resume",
                            "legacy"]
    assert params["consistency"].default == ConsistencyOptions()
    assert params["wire"].default == WireOptions()
    assert params["observability"].default == ObservabilityOptions()
    assert params["legacy"].kind is inspect.Parameter.VAR_KEYWORD


def test_every_moved_keyword_is_a_field_of_its_group() -> None:
    groups = {"consistency": ConsistencyOptions, "wire": WireOptions, "observability": ObservabilityOptions}
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in groups.items()}
    added_since = {"on_wait", "push_credit_bytes", "retain_freed_memory", "stream_processes", "tables"}  # never flat keywords
    assert {name for group in fields.values() for name in group} == set(MOVED_KEYWORDS) | added_since
    for name, group in MOVED_KEYWORDS.items():
        assert name in fields[group], (name, group)


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"mode": "async"}, "mode= moved to consistency=ConsistencyOptions(mode=...)"),
    ({"mode": "ssp", "staleness": 2},
     "mode=, staleness= moved to consistency=ConsistencyOptions(mode=..., staleness=...)"),
    ({"chunk_bytes": 256}, "chunk_bytes= moved to wire=WireOptions(chunk_bytes=...)"),
    ({"rpc_timeout": 5.0, "security": None}, "rpc_timeout=, security= moved to wire=WireOptions(rpc_timeout=..., "
                                             "security=...)"),
    ({"metrics_port": 0}, "metrics_port= moved to observability=ObservabilityOptions(metrics_port=...)"),
    ({"on_membership_change": print}, "on_membership_change= moved to observability=ObservabilityOptions("),
])
def test_a_moved_keyword_names_its_group(kwargs: dict, fix: str) -> None:
    with pytest.raises(TypeError) as err:
        wrap(servers=DEAD, **kwargs)
    assert fix in str(err.value) and str(err.value).startswith("DistributedOptimizer()"), str(err.value)


def test_moved_keywords_of_several_groups_and_unknown_ones_are_named_together() -> None:
    with pytest.raises(TypeError) as err:
        wrap(servers=DEAD, mode="async", chunk_bytes=256, checksum=True, metrics_host="h", frobnicate=1)
    message = str(err.value)
    assert "mode= moved to consistency=ConsistencyOptions(mode=...)" in message
    assert "chunk_bytes=, checksum= moved to wire=WireOptions(chunk_bytes=..., checksum=...)" in message
    assert "metrics_host= moved to observability=ObservabilityOptions(metrics_host=...)" in message
    assert "unexpected keyword argument(s) 'frobnicate'" in message
    with pytest.raises(TypeError, match=r"^DistributedOptimizer\(\) got unexpected keyword argument\(s\) 'lr'$"):
        wrap(servers=DEAD, lr=0.1)
    assert "NodeOptimizer() takes" in str(moved_keywords_error(["mode"], where="NodeOptimizer"))


@pytest.mark.parametrize("group", ["consistency", "wire", "observability"])
def test_a_group_of_the_wrong_type_is_refused(group: str) -> None:
    with pytest.raises(TypeError, match=f"{group}= takes a shardps.worker.config"):
        wrap(servers=DEAD, **{group: {"mode": "async"}})


def test_servers_and_accumulation_are_checked_before_connecting() -> None:
    with pytest.raises(ValueError, match="at least one shard address"):
        wrap(servers=" , ")
    with pytest.raises(ValueError, match="is not host:port"):
        wrap(servers="localhost")
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        wrap(servers=[DEAD], backward_passes_per_step=0)


# ------------------------------------------------------------ NodeOptimizer's pass-through
def test_node_optimizer_forwards_only_distributed_optimizer_keywords() -> None:
    params = inspect.signature(DistributedOptimizer).parameters
    assert FORWARDED_KEYWORDS <= set(params)
    assert {"consistency", "wire", "observability", "max_grad_norm"} <= FORWARDED_KEYWORDS


def test_node_optimizer_refuses_wrong_keywords_on_every_rank_before_any_collective() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def node(**kwargs) -> NodeOptimizer:  # torch.distributed is not initialised: the checks come first
        return NodeOptimizer(opt, model.named_parameters(), servers=DEAD, node_id="node0", **kwargs)

    with pytest.raises(TypeError, match=r"^NodeOptimizer\(\) takes .*mode=, staleness= moved to consistency="):
        node(mode="ssp", staleness=1)
    with pytest.raises(TypeError, match=r"chunk_bytes= moved to wire=WireOptions\(chunk_bytes=\.\.\.\)"):
        node(chunk_bytes=256)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        node(frobnicate=1)
    with pytest.raises(TypeError, match="takes node_id="):
        node(worker_id="w0")
    with pytest.raises(TypeError, match="wire= takes a shardps.worker.config.WireOptions"):
        node(wire={"chunk_bytes": 256})
    for name in ("model", "grad_scaler", "push_during_backward"):
        with pytest.raises(ValueError, match=f"does not take {name}="):
            node(**{name: None})
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        node(consistency=ConsistencyOptions(mode="async"), wire=WireOptions(chunk_bytes=256))
