"""TLS, mutual TLS and bearer tokens on real shard processes, with certificates made here for each run.

Clients the shard should not trust are refused: a failed handshake gets
UNAVAILABLE and a missing or wrong token gets UNAUTHENTICATED, for every call
kind. After each refusal the shard's version, members and parameter digest
are the same as before. Health answers without a token, also on the
plaintext ``--health-port``.
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from shardps.proto import shardps_pb2 as pb
from shardps.common.codec import encode_round
from shardps.common.security import ChannelSecurity
from shardps.worker.session.client import ShardClient, ShardRpcError
from shardps.worker.config import WireOptions
from shardps.worker.optimizer import DistributedOptimizer
from tests.support.forked import ForkedCluster, ForkedShard
from tests.support.pki import TOKEN, Pki, make_pki
from tests.support.raw import SERVING, health_status, snapshot

STEPS = 3
PATH = "/shardps.v1.Shard/"


# ---- shards -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_cluster(pki):
    """Two shards: TLS, a bearer token, and plaintext health on a second port."""
    cluster = ForkedCluster(2, extra_args=("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
                                           "--auth-token-file", pki.path("token"), "--health-port", "0")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def mtls_cluster(pki):
    """One shard: mutual TLS (client certificates signed by the test CA), no token."""
    cluster = ForkedCluster(1, extra_args=("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
                                           "--tls-ca", pki.path("ca.pem"))).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def trained_tls(tls_cluster, pki) -> tuple[ForkedCluster, nn.Module]:
    """The TLS shards after one worker trained STEPS steps over TLS with the token, and the model it trained."""
    return tls_cluster, train(tls_cluster.addresses, pki.security(token=TOKEN))


def state(addresses: list[str], security: ChannelSecurity) -> list[dict]:
    """Version, members, open round and parameter digest of every shard, read by a trusted client."""
    out = []
    for i, address in enumerate(addresses):
        client = ShardClient(address, index=i, security=security, connect_timeout=10.0, rpc_timeout=10.0)
        try:
            out.append(snapshot(client))
        finally:
            client.close()
    return out


# ---- training ---------------------------------------------------------------------------------------------


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def run(model: nn.Module, optimizer) -> nn.Module:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def train(addresses: list[str], security: ChannelSecurity) -> nn.Module:
    model, opt = make()
    with DistributedOptimizer(opt, model.named_parameters(), servers=addresses,
                              wire=WireOptions(chunk_bytes=256, connect_timeout=10.0, security=security)) as dist:
        run(model, dist)
        assert dist.version == STEPS
    return model


def assert_trained(model: nn.Module) -> None:
    """``model`` holds what the same steps give with the plain torch optimizer."""
    for got, want in zip(model.parameters(), run(*make()).parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


# ---- raw calls of every kind ------------------------------------------------------------------------------


def every_kind(channel: grpc.Channel, metadata=None, timeout: float = 3.0) -> dict[str, tuple]:
    """Call the shard with each of the four call kinds; ``{method: (status code, details)}``.

    Reset would drop an idle job and Push would stage gradients if the shard let them through.
    """
    header = encode_round(pb.RoundHeader(worker_id="intruder", session="s", round=STEPS))
    calls = {
        "Stats": lambda: channel.unary_unary(PATH + "Stats")(
            pb.StatsRequest(digest=True).SerializeToString(), timeout=timeout, metadata=metadata),
        "Reset": lambda: channel.unary_unary(PATH + "Reset")(
            pb.ResetRequest().SerializeToString(), timeout=timeout, metadata=metadata),
        "Pull": lambda: list(channel.unary_stream(PATH + "Pull")(
            pb.PullRequest(worker_id="intruder", session="s").SerializeToString(), timeout=timeout,
            metadata=metadata)),
        "Push": lambda: channel.stream_unary(PATH + "Push")(iter([header]), timeout=timeout, metadata=metadata),
        "PushPull": lambda: list(channel.stream_stream(PATH + "PushPull")(
            iter([header]), timeout=timeout, metadata=metadata)),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = (grpc.StatusCode.OK, "")
        except grpc.RpcError as exc:
            out[name] = (exc.code(), exc.details() or "")
    return out


def assert_all(results: dict[str, tuple], code: grpc.StatusCode, *words: str) -> None:
    for method, (got, details) in results.items():
        assert got == code, f"{method}: {got.name}: {details}"
        assert TOKEN not in details and "wrong-token" not in details, "a refusal must never echo a token"
        for word in words:
            assert word in details, f"{method}: {details!r} lacks {word!r}"


# ---- tests ------------------------------------------------------------------------------------------------


def test_training_over_tls_with_a_token(trained_tls, pki) -> None:
    tls_cluster, model = trained_tls
    assert_trained(model)
    assert [s["version"] for s in state(tls_cluster.addresses, pki.security(token=TOKEN))] == [STEPS, STEPS]


def test_training_over_mutual_tls(mtls_cluster, pki) -> None:
    assert_trained(train(mtls_cluster.addresses, pki.security(client="client")))


def test_stream_processes_train_over_mutual_tls_with_a_token(pki) -> None:
    """A worker's stream processes open channels of their own with its ChannelSecurity: the shard's CA, the
    client certificate and the token; the rounds go through them and train as the plain optimizer does."""
    cluster = ForkedCluster(1, extra_args=("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
                                           "--tls-ca", pki.path("ca.pem"), "--auth-token-file", pki.path("token")))
    cluster.start()
    try:
        model, opt = make()
        wire = WireOptions(chunk_bytes=256, connect_timeout=10.0, stream_processes=True,
                           security=pki.security(client="client", token=TOKEN))
        with DistributedOptimizer(opt, model.named_parameters(), servers=cluster.addresses, wire=wire) as dist:
            run(model, dist)
            assert dist.version == STEPS
            assert all(pid is not None for pid in dist.stream_process_pids)  # the rounds went through them
        assert_trained(model)
    finally:
        cluster.stop()


def test_failed_handshakes_are_unavailable_and_change_nothing(trained_tls, mtls_cluster, pki) -> None:
    tls_cluster = trained_tls[0]
    trusted_tls, trusted_mtls = pki.security(token=TOKEN), pki.security(client="client")
    before = state(tls_cluster.addresses, trusted_tls), state(mtls_cluster.addresses, trusted_mtls)
    tls, mtls = tls_cluster.addresses[0], mtls_cluster.addresses[0]
    token = (("authorization", f"Bearer {TOKEN}"),)
    attempts = {
        "plaintext to a TLS shard": grpc.insecure_channel(tls),
        "a client that trusts another CA": pki.security(ca="rogue-ca.pem", token=TOKEN).channel(tls),
        "no client certificate (mTLS)": pki.security().channel(mtls),
        "a client certificate of another CA (mTLS)": pki.security(client="rogue").channel(mtls),
    }
    for what, channel in attempts.items():
        with channel:
            results = every_kind(channel, metadata=token)
        for method, (code, details) in results.items():
            assert code == grpc.StatusCode.UNAVAILABLE, f"{what}: {method}: {code.name}: {details}"
    assert (state(tls_cluster.addresses, trusted_tls), state(mtls_cluster.addresses, trusted_mtls)) == before

    # ShardClient: a handshake that fails shows up as the connect timeout, whose message points at TLS
    with pytest.raises(ConnectionError, match="--tls-ca"):
        ShardClient(tls, index=0, connect_timeout=1.0)
    with pytest.raises(ConnectionError, match=r"client certificate \(--tls-cert/--tls-key"):
        ShardClient(mtls, index=0, connect_timeout=1.0, security=pki.security())


def test_missing_or_wrong_token_is_unauthenticated_and_changes_nothing(trained_tls, pki) -> None:
    tls_cluster, trusted = trained_tls[0], pki.security(token=TOKEN)
    before = state(tls_cluster.addresses, trusted)
    assert before[0]["initialised"] and before[0]["version"] == STEPS  # an idle job: Reset would drop it
    address = tls_cluster.addresses[0]
    with pki.security().channel(address) as channel:  # TLS, but no token
        assert_all(every_kind(channel), grpc.StatusCode.UNAUTHENTICATED, "missing bearer token", "--auth-token-file")
        assert_all(every_kind(channel, metadata=(("authorization", "Bearer wrong-token"),)),
                   grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token")
        assert_all(every_kind(channel, metadata=(("authorization", f"Basic {TOKEN}"),)),
                   grpc.StatusCode.UNAUTHENTICATED, "not 'Bearer <token>'")
    with pki.security(token="wrong-token").channel(address) as channel:  # the interceptor sends its own token
        assert_all(every_kind(channel), grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token")

    wrong = ShardClient(address, index=0, security=pki.security(token="wrong-token"), connect_timeout=10.0)
    try:
        with pytest.raises(ShardRpcError) as err:  # not retried: UNAUTHENTICATED is final
            wrong.reset()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        wrong.close()
    assert state(tls_cluster.addresses, trusted) == before


def test_health_needs_no_token_and_has_a_plaintext_port(tls_cluster, pki) -> None:
    request = health_pb2.HealthCheckRequest(service="shardps.v1.Shard")
    for shard, address in enumerate(tls_cluster.addresses):
        with pki.security().channel(address) as channel:  # the TLS main port, no token
            assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status == SERVING
        plain = tls_cluster.endpoints[shard]["health"]  # its `... health on HOST:PORT` line
        assert health_status(plain, timeout=5) == SERVING  # plaintext, no token
        with grpc.insecure_channel(plain) as channel:  # the health port holds nothing else
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(PATH + "Stats")(pb.StatsRequest().SerializeToString(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_token_without_tls(start_cluster, pki) -> None:
    cluster = start_cluster(1, extra_args=("--auth-token-file", pki.path("token")))
    address = cluster.addresses[0]
    client = ShardClient(address, index=0, security=ChannelSecurity(token=TOKEN), connect_timeout=10.0)
    try:
        assert client.stats(digest=True).version == 0
    finally:
        client.close()
    with grpc.insecure_channel(address) as channel:
        assert_all(every_kind(channel), grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
    assert health_status(address, timeout=5) == SERVING


def test_channel_security_from_files(pki, tmp_path) -> None:
    full = ChannelSecurity.from_files(tls_ca=pki.path("ca.pem"), tls_cert=pki.path("client.pem"),
                                      tls_key=pki.path("client.key"), auth_token_file=pki.path("token"))
    assert full.tls and full.token == TOKEN and full.cert == pki.read("client.pem")
    assert TOKEN not in repr(full) and "PRIVATE" not in repr(full)
    assert ChannelSecurity.from_files() == ChannelSecurity()
    (tmp_path / "empty").write_text(" \n")
    bad = {
        "--tls-ca": dict(tls_ca=str(tmp_path / "missing.pem")),
        "--tls-key": dict(tls_ca=pki.path("ca.pem"), tls_cert=pki.path("client.pem"), tls_key=pki.path("client.pem")),
        "--tls-cert and --tls-key go together": dict(tls_ca=pki.path("ca.pem"), tls_cert=pki.path("client.pem")),
        "needs --tls-ca": dict(tls_cert=pki.path("client.pem"), tls_key=pki.path("client.key")),
        "--auth-token-file": dict(auth_token_file=str(tmp_path / "empty")),
    }
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ChannelSecurity.from_files(**kwargs)


@pytest.mark.parametrize("cert, key, message", [
    ("server.key", "server.key", r"--tls-cert \S+server\.key: no PEM certificate"),
    ("server.pem", "client.key", r"--tls-key is not the key of --tls-cert"),
])
def test_shard_refuses_to_start_on_a_bad_certificate(pki, tmp_path, cert: str, key: str, message: str) -> None:
    log = tmp_path / "shard.log"
    shard = ForkedShard(["--shard-index", "0", "--num-shards", "1", "--tls-cert", pki.path(cert),
                         "--tls-key", pki.path(key)], str(log))
    try:
        assert shard.wait(timeout=30) == 1
    finally:
        shard.kill()
    assert re.search(message, log.read_text()), log.read_text()
