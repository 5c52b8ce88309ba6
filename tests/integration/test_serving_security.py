"""TLS, mutual TLS and the bearer token on ``shardps serve``'s Serving port, in front of shards that require them.

Real processes and real gRPC, with certificates made here for each run (``tests.support.pki``): two shards
serving mutual TLS with a token, a worker training over them, and ``shardps serve`` reading them with its
``--shards-*`` flags while serving its own port with mutual TLS and a token (``--tls-*``,
``--auth-token-file``) and plaintext health on ``--health-port``:

- a Lookup with the token over mutual TLS answers the shards' rows; without the token, or with another one, it
  is refused UNAUTHENTICATED (the shards' check); plaintext, or TLS without a client certificate, fails the
  handshake; health answers without the token, on both ports;
- bad settings refuse to start, naming the flag: a certificate without its key, a missing file, a token over
  plaintext on a host that is not loopback (unless ``--allow-token-over-plaintext``, which logs a WARNING), and
  a token over plaintext to shards that are not on loopback.
"""

from __future__ import annotations

import subprocess

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from shardps.common.rows import ids_bytes
from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc
from shardps.worker import DistributedOptimizer, ShardedEmbedding, WireOptions
from shardps.worker.embedding.export import export_table
from tests.support.forked import ForkedCluster
from tests.support.pki import TOKEN, Pki, make_pki
from tests.support.procs import run_module
from tests.support.serve import Serve, code_of

TABLES = ("user", "item")
TIMEOUT = 60.0  # seconds any one wait of this file may take


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def train(servers: str, pki: Pki) -> tuple[nn.Module, DistributedOptimizer]:
    """A job with tables ``user`` and ``item`` trained 3 steps over mutual TLS with the token (left open)."""
    model = nn.ModuleDict({name: ShardedEmbedding(None, 4, name=name) for name in TABLES})
    model.bias = nn.Parameter(torch.zeros(1))
    dist = DistributedOptimizer(torch.optim.SGD([model.bias], lr=0.1), [("bias", model.bias)], servers=servers,
                                model=model, worker_id="w0",
                                wire=WireOptions(connect_timeout=10.0, security=pki.security("client", TOKEN)),
                                sparse_optimizer=torch.optim.SGD([model[t].handle for t in TABLES], lr=1.0))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        dist.zero_grad()
        u, i = model["user"](torch.randint(0, 30, (8,), generator=g)), model["item"](torch.randint(0, 30, (8,),
                                                                                                   generator=g))
        ((u * i).sum(1) + model.bias - 3.0).pow(2).mean().backward()
        dist.step()
    dist.tables.settle("user")
    return model, dist


def test_serve_with_tls_and_a_token_in_front_of_tls_and_token_shards(pki):
    shard_flags = ("--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"), "--tls-ca",
                   pki.path("ca.pem"), "--auth-token-file", pki.path("token"))
    with ForkedCluster(2, extra_args=shard_flags) as shards:
        model, dist = train(shards.servers, pki)
        serve = None
        try:
            serve = Serve("--servers", shards.servers, "--tables", ",".join(TABLES), "--period", "0.2",
                          "--dense-every", "0", *shard_flags, "--health-port", "0",
                          "--shards-tls-ca", pki.path("ca.pem"), "--shards-tls-cert", pki.path("client.pem"),
                          "--shards-tls-key", pki.path("client.key"), "--shards-auth-token-file", pki.path("token"))
            health_address = serve.expect("health on ")
            address = serve.expect("serving on ")
            serve.expect("serving tables ")  # it read the shards over mutual TLS with the token

            asked = torch.arange(40)
            want = export_table(dist.clients, "user").lookup(asked)
            request = pb.LookupRequest(table="user", ids=ids_bytes(asked))
            trusted = pki.security("client", TOKEN).channel(address)
            reply = pb_grpc.ServingStub(trusted).Lookup(request, timeout=10)
            rows = torch.frombuffer(bytearray(reply.rows), dtype=torch.float32).view(40, reply.dim)
            assert torch.equal(rows, want), "over mutual TLS with the token, the replica answers the shards' rows"
            answers = list(pb_grpc.ServingStub(trusted).Query(iter([pb.ServingQuery(tag=3, lookup=request)]),
                                                              timeout=10))
            assert [a.tag for a in answers] == [3] and answers[0].lookup.rows == reply.rows  # a Query stream too

            # The token is checked as on the shards: none, or another one, is UNAUTHENTICATED before the handler.
            for token in (None, "another-token"):
                channel = pki.security("client", token).channel(address)
                code, details = code_of(lambda: pb_grpc.ServingStub(channel).Lookup(request, timeout=10))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (token, code, details)
                assert "--auth-token-file" in details and TOKEN not in details
                code, _ = code_of(lambda: list(pb_grpc.ServingStub(channel).Query(
                    iter([pb.ServingQuery(tag=1, lookup=request)]), timeout=10)))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (token, code)  # a stream is checked as a call
                # health needs no token on the TLS port
                assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10) \
                    .status == health_pb2.HealthCheckResponse.SERVING
                channel.close()
            # Without TLS, or without a client certificate (mutual TLS), there is no connection at all.
            for channel in (grpc.insecure_channel(address), pki.security(None, TOKEN).channel(address),
                            pki.security("rogue", TOKEN).channel(address)):
                code, _ = code_of(lambda: pb_grpc.ServingStub(channel).Lookup(request, timeout=3))
                assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), code
                channel.close()
            # The plaintext health port answers probes that cannot do TLS, with no token.
            with grpc.insecure_channel(health_address) as channel:
                assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10) \
                    .status == health_pb2.HealthCheckResponse.SERVING
                code, _ = code_of(lambda: pb_grpc.ServingStub(channel).Lookup(request, timeout=10))
                assert code == grpc.StatusCode.UNIMPLEMENTED, "the health port serves health only"
            # No --model: Predict is refused, naming the flag (after the token check).
            code, details = code_of(lambda: pb_grpc.ServingStub(trusted).Predict(pb.PredictRequest(), timeout=10))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "--model" in details, (code, details)
            trusted.close()
            assert serve.stop() == 0
            assert TOKEN not in "".join(serve.seen) + serve.proc.stdout.read()
            serve = None
        finally:
            if serve is not None:
                serve.proc.kill()
                serve.proc.wait(10)
            dist.close()


def refused(*args: str) -> subprocess.CompletedProcess:
    """``shardps serve ARGS`` against shards that are not there; it must refuse to start."""
    proc = run_module("shardps.cli.main", "serve", "--servers", "127.0.0.1:1", "--tables", "user", *args, timeout=60)
    assert proc.returncode != 0 and "serving on" not in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert TOKEN not in proc.stdout + proc.stderr
    return proc


def test_bad_settings_refuse_to_start_naming_the_flag(pki, tmp_path):
    assert "--tls-key" in refused("--tls-cert", pki.path("server.pem")).stderr
    assert "--tls-cert" in refused("--tls-ca", pki.path("ca.pem")).stderr
    missing = refused("--tls-cert", pki.path("server.pem"), "--tls-key", str(tmp_path / "nope.key")).stderr
    assert "--tls-key" in missing and "nope.key" in missing
    (tmp_path / "bad.key").write_text("not a key\n")
    assert "--tls-key" in refused("--tls-cert", pki.path("server.pem"), "--tls-key", str(tmp_path / "bad.key")).stderr
    assert "--auth-token-file" in refused("--auth-token-file", str(tmp_path / "no-token")).stderr
    assert "--shards-tls-key" in refused("--shards-tls-ca", pki.path("ca.pem"), "--shards-tls-cert",
                                         pki.path("client.pem")).stderr
    assert "--shards-tls-ca" in refused("--shards-tls-ca", str(tmp_path / "no-ca.pem")).stderr
    assert "--nice must be in [-20, 19]" in refused("--nice", "25").stderr
    assert "--realtime must be in [1, 99]" in refused("--realtime", "100").stderr
    assert "--realtime and --nice: give one" in refused("--realtime", "5", "--nice", "-5").stderr
    assert "--threads 1" in refused("--realtime", "5", "--threads", "2").stderr
    assert "--freshness-redis 'http://broker:6379'" in refused("--freshness-redis", "http://broker:6379").stderr
    # A token over plaintext on a host that is not loopback (0.0.0.0: every interface) is refused at start.
    plain = refused("--host", "0.0.0.0", "--auth-token-file", pki.path("token")).stderr
    assert "--allow-token-over-plaintext" in plain and "--tls-cert" in plain and "0.0.0.0" in plain, plain
    # ... and so is sending the shards' token in plaintext to shards that are not on loopback.
    far = run_module("shardps.cli.main", "serve", "--servers", "0.0.0.0:1", "--tables", "user",
                     "--shards-auth-token-file", pki.path("token"), timeout=60)
    assert far.returncode != 0 and "--shards-allow-token-over-plaintext" in far.stderr, far.stderr


def test_a_token_over_plaintext_beyond_loopback_starts_when_allowed_with_a_warning(pki, start_cluster):
    shard = start_cluster(1)  # up (the replica connects at start) but holding no job: the replica waits for it
    serve = Serve("--servers", shard.servers, "--tables", "user", "--host", "0.0.0.0", "--auth-token-file",
                  pki.path("token"), "--allow-token-over-plaintext")
    try:
        serve.expect("serving on ")
    finally:
        status = serve.stop()
    out = "".join(serve.seen) + serve.proc.stdout.read()
    assert status == 0 and "WARNING" in out and "clear text" in out and TOKEN not in out, out
