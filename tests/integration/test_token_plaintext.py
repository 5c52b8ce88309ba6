"""A bearer token never goes over plaintext to or from an address that is not loopback, unless the operator says so.

Both ends: ``shardps-server --auth-token-file`` without TLS refuses to start
on a host that is not loopback (``0.0.0.0`` included), and clients
(``ShardClient``/``DistributedOptimizer`` through ``ChannelSecurity``, the
``shardps`` commands) refuse to send the token there before connecting. With
``--allow-token-over-plaintext`` / ``allow_token_over_plaintext=True`` both
go ahead and log a WARNING. The non-loopback address is a real one of this
machine (the source address of its route out).
"""

from __future__ import annotations

import logging
import socket

import pytest
import torch
from torch import nn

from shardps.common.security import ChannelSecurity, address_hosts, is_loopback_host
from shardps.worker import DistributedOptimizer, WireOptions
from shardps.worker.session.client import ShardClient
from tests.support.pki import TOKEN, make_pki
from tests.support.procs import run_module

FLAG = "--allow-token-over-plaintext"


def local_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (its source address towards other hosts), or None."""
    for destination in ("10.254.254.254", "192.0.2.1", "198.51.100.1"):  # connecting a UDP socket sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((destination, 9))
            except OSError:
                continue
            address = probe.getsockname()[0]
        if not is_loopback_host(address):
            with socket.socket() as s:
                try:
                    s.bind((address, 0))
                except OSError:
                    continue
            return address
    return None


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def address() -> str:
    found = local_address()
    if found is None:
        pytest.skip("this machine has no address outside the loopback network to serve on")
    return found


def server(*args: str):
    return run_module("shardps.cli.server", "--shard-index", "0", "--num-shards", "1", "--port", "0", *args,
                      timeout=60)


def test_loopback_is_judged_on_the_resolved_address() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("127.8.9.10") and is_loopback_host("::1")
    assert is_loopback_host("localhost") and is_loopback_host("::ffff:127.0.0.1")
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.0.2.2", "fd00::2", "no-such-host.invalid"):
        assert not is_loopback_host(host), host
    assert address_hosts("[::1]:50051") == ["::1"] and address_hosts("dns:///example.com:443") == ["example.com"]
    assert address_hosts("ipv4:127.0.0.1:1,10.0.0.1:2") == ["127.0.0.1", "10.0.0.1"]


def test_the_shard_refuses_to_serve_a_token_in_plaintext_beyond_loopback(pki, address) -> None:
    for host in ("0.0.0.0", address):
        proc = server("--host", host, "--auth-token-file", pki.path("token"))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "--tls-cert/--tls-key" in proc.stderr and FLAG in proc.stderr and "listening" not in proc.stdout
        assert TOKEN not in proc.stderr


def test_clients_refuse_to_send_a_token_in_plaintext_beyond_loopback(pki, address, start_cluster) -> None:
    cluster = start_cluster(1, host=address, extra_args=("--auth-token-file", pki.path("token"), FLAG))
    assert cluster.addresses[0].startswith(f"{address}:")
    log = cluster.log_path(0).read_text()
    assert "WARNING" in log and "clear text" in log and TOKEN not in log
    target = cluster.addresses[0]

    with pytest.raises(ValueError, match=FLAG):  # refused before any connection: nothing was sent
        ShardClient(target, index=0, connect_timeout=5.0, security=ChannelSecurity(token=TOKEN))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="--tls-cert/--tls-key"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), servers=target,
                             wire=WireOptions(connect_timeout=5.0, security=ChannelSecurity(token=TOKEN)))
    refused = run_module("shardps.cli.main", "stats", "--servers", target, "--auth-token-file", pki.path("token"))
    assert refused.returncode == 1 and FLAG in refused.stderr and refused.stdout == "", refused.stderr

    # the operator said so: both ends go ahead, with a WARNING
    logger = logging.getLogger("shardps.common.security")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        client = ShardClient(target, index=0, connect_timeout=10.0,
                             security=ChannelSecurity(token=TOKEN, allow_token_over_plaintext=True))
        try:
            assert client.stats().shard_index == 0
        finally:
            client.close()
    finally:
        logger.removeHandler(handler)
    assert [r.levelname for r in records] == ["WARNING"] and "clear text" in records[0].getMessage()
    allowed = run_module("shardps.cli.main", "stats", "--servers", target, "--auth-token-file", pki.path("token"), FLAG)
    assert allowed.returncode == 0, allowed.stderr
    assert "WARNING" in allowed.stderr and "clear text" in allowed.stderr and TOKEN not in allowed.stderr
    health = run_module("shardps.cli.main", "health", "--servers", target, "--auth-token-file", pki.path("token"))
    assert health.returncode == 0, health.stdout + health.stderr  # health never carries the token: no refusal


def test_a_token_on_loopback_needs_no_flag_and_logs_nothing(pki, start_cluster) -> None:
    cluster = start_cluster(1, extra_args=("--auth-token-file", pki.path("token")))
    assert "clear text" not in cluster.log_path(0).read_text()
    proc = run_module("shardps.cli.main", "stats", "--servers", cluster.servers, "--auth-token-file", pki.path("token"))
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr
