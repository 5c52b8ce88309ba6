"""``Serving.Predict`` of ``shardps serve --model``: the job's own model, made local from the replica's state.

Real shards, a real worker and a real ``shardps serve`` process: the MovieLens matrix factorisation
(``shardps.apps.movielens.MF``, with ``MovieLensConfig``'s default sizes) trains a few steps on 2 shards while
the replica serves ``--model shardps.apps.movielens:serving_model``, then stops. Once the replica caught up
(its Lookup answers equal the rows of the job's saved ``model.state_dict()``, every table):

- Predict's scores equal, bit for bit, those of ``shardps.local_model`` built from that saved state, and equal the
  ``Score`` call's answers for the same user and items within 1e-6; Predict is counted and timed in the metrics;
- bad requests get the codes the docs give: a feature with both or neither value fields, a shape that does
  not hold its elements, too many elements or a keyword ``forward`` does not take: INVALID_ARGUMENT naming the
  feature; a state without the dense parameters: UNAVAILABLE;
- callers asking at once for the same state wait for one local model;
- a ``Query`` stream answers Lookup, Score and Predict queries in order, tagged, equal to their own calls'
  answers; a refused query (an unknown table, a bad feature, an empty query) gets its code and message in its
  answer and the stream goes on; the queries are counted under their methods; a stream beyond the replica's
  most (half its 8 threads) ends with RESOURCE_EXHAUSTED (``shardps_serving_query_streams`` says 4), and one
  closed makes room; SIGTERM with a stream open ends it after the calls' 5 s grace and the replica exits 0.
"""

from __future__ import annotations

import queue
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import save_file

import shardps
from shardps.apps.movielens import MF, MovieLensConfig, serving_model
from shardps.common.rows import ids_bytes
from shardps.proto import shardps_pb2 as pb
from shardps.proto import shardps_pb2_grpc as pb_grpc
from shardps.worker import DistributedOptimizer
from shardps.worker.serving.predict import PredictError, Predictor, decode_features
from shardps.worker.serving.replica import Replica
from shardps.worker.serving.service import MAX_IDS
from tests.support.forked import ForkedCluster
from tests.support.serve import Serve, code_of

TABLES = ("user", "item", "user_bias", "item_bias")
MODEL = "shardps.apps.movielens:serving_model"
TIMEOUT = 60.0  # seconds any one wait of this file may take


def feature(name: str, values: torch.Tensor, shape=None) -> pb.Feature:
    data = values.contiguous().numpy().tobytes()
    shape = list(values.shape) if shape is None else shape
    if values.dtype == torch.int64:
        return pb.Feature(name=name, shape=shape, int64_values=data)
    return pb.Feature(name=name, shape=shape, float32_values=data)


def scores_of(reply: pb.PredictReply) -> torch.Tensor:
    return torch.frombuffer(bytearray(reply.scores), dtype=torch.float32).view(list(reply.shape))


def job(servers: str) -> tuple[MF, DistributedOptimizer]:
    """The MovieLens job's model and optimizers (as ``train_worker`` makes them), at its default sizes."""
    fields = MovieLensConfig.__dataclass_fields__
    model = MF(fields["dim"].default, fields["init_scale"].default, 3.5)
    dense = torch.optim.Adam([model.global_bias], lr=0.05)
    sparse = torch.optim.Adagrad([{"params": [model.user.handle, model.item.handle]},
                                  {"params": [model.user_bias.handle, model.item_bias.handle], "lr": 0.08}],
                                 lr=0.05, eps=1e-10)
    return model, DistributedOptimizer(dense, model.named_parameters(), servers=servers, model=model,
                                       worker_id="movielens-rank0", sparse_optimizer=sparse)


def train(model: MF, dist: DistributedOptimizer, steps: int, g: torch.Generator) -> None:
    for _ in range(steps):
        users, items = torch.randint(1, 60, (64,), generator=g), torch.randint(1, 90, (64,), generator=g)
        ratings = torch.randint(1, 6, (64,), generator=g).float()
        dist.zero_grad()
        (model(users, items)[0] - ratings).pow(2).mean().backward()
        dist.step()
    for name in TABLES:
        dist.tables.settle(name)


def streams_open(metrics: str) -> float:
    """``shardps_serving_query_streams`` on the replica's metrics page."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as page:
        line = next(x for x in page.read().decode().splitlines() if x.startswith("shardps_serving_query_streams "))
    return float(line.split()[1])


def check_query_stream(stub, metrics: str, users: torch.Tensor, candidates: torch.Tensor) -> None:
    """A Query stream's answers against the calls' own (training has stopped and the replica caught up)."""
    ids, items = torch.arange(100), torch.arange(1, 90)
    lookup = pb.LookupRequest(table="item", ids=ids_bytes(ids))
    score = pb.ScoreRequest(user=7, items=ids_bytes(items))
    predict = pb.PredictRequest(features=[feature("users", users), feature("items", candidates)])
    queries = [pb.ServingQuery(tag=10, lookup=lookup), pb.ServingQuery(tag=11, score=score),
               pb.ServingQuery(tag=12, predict=predict),
               pb.ServingQuery(tag=13, lookup=pb.LookupRequest(table="nope", ids=ids_bytes(ids))),
               pb.ServingQuery(tag=14, predict=pb.PredictRequest(features=[feature("items", candidates)])),
               pb.ServingQuery(tag=15),
               pb.ServingQuery(tag=16, lookup=pb.LookupRequest(table="user", ids=b"\0" * 7)),
               pb.ServingQuery(tag=17, lookup=lookup)]
    answers = list(stub.Query(iter(queries), timeout=30))
    assert [a.tag for a in answers] == list(range(10, 18))
    ok = [answers[i] for i in (0, 1, 2, 7)]
    assert all(a.code == 0 and not a.error for a in ok)
    assert answers[0].lookup.rows == answers[7].lookup.rows == stub.Lookup(lookup, timeout=10).rows
    assert answers[1].score.scores == stub.Score(score, timeout=10).scores
    assert answers[2].predict.scores == stub.Predict(predict, timeout=10).scores
    assert list(answers[2].predict.shape) == [users.numel()]
    refused = {13: (grpc.StatusCode.NOT_FOUND, "'nope'"), 14: (grpc.StatusCode.INVALID_ARGUMENT, "users"),
               15: (grpc.StatusCode.INVALID_ARGUMENT, "holds none"), 16: (grpc.StatusCode.INVALID_ARGUMENT, "int64")}
    for a in answers[3:7]:
        code, text = refused[a.tag]
        assert a.code == code.value[0] and text in a.error and a.WhichOneof("answer") is None, (a.tag, a)

    # open streams hold a thread each: the replica (8 threads) answers 4 at once and refuses a fifth
    feeds = [queue.Queue() for _ in range(5)]

    def fed(q: queue.Queue):
        while (item := q.get(timeout=30)) is not None:
            yield item

    streams = []
    try:
        for q in feeds[:4]:
            streams.append(stub.Query(fed(q), timeout=60))
            q.put(pb.ServingQuery(tag=1, lookup=lookup))
            assert next(streams[-1]).lookup.rows == answers[0].lookup.rows  # open and answering
        fifth = stub.Query(fed(feeds[4]), timeout=30)
        code, details = code_of(lambda: next(fifth))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4 Query streams" in details, (code, details)
        assert streams_open(metrics) == 4
        feeds[0].put(None)  # the first stream ends; a new one is answered
        assert list(streams[0]) == []
        deadline = time.monotonic() + 10
        while True:  # the server lets the finished stream's slot go once its handler returns
            again = stub.Query(iter([pb.ServingQuery(tag=2, score=score)]), timeout=30)
            code, _ = code_of(lambda: list(again))
            if code == grpc.StatusCode.OK or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert code == grpc.StatusCode.OK
    finally:
        for q in feeds:
            q.put(None)
        for s in streams:
            s.cancel()


def test_predict_equals_the_local_model_of_the_saved_state_and_score(tmp_path):
    with ForkedCluster(2) as shards:
        model, dist = job(shards.servers)
        g = torch.Generator().manual_seed(0)
        serve = None
        try:
            train(model, dist, 3, g)
            serve = Serve("--servers", shards.servers, "--tables", ",".join(TABLES), "--period", "0.2",
                          "--dense-every", "0", "--metrics-port", "0", "--model", MODEL)
            address = serve.expect("serving on ")
            metrics = serve.expect("metrics on ")
            serve.expect("serving tables ")
            train(model, dist, 4, g)  # while the replica serves: it catches up by deltas
            # The saved state: the live model's state_dict() (every table read from the shards), saved and loaded
            # as a user would. (`shardps export --servers` refuses this job: the shard holding no dense key reports
            # version 0 in its export stream.)
            out = tmp_path / "model.safetensors"
            save_file(model.state_dict(), str(out))
            local = shardps.local_model(serving_model(), out).eval()

            channel = grpc.insecure_channel(address)
            stub = pb_grpc.ServingStub(channel)
            asked = torch.arange(100)
            # Training stopped before this call, which answers from state `stopped`: state stopped + 1 was not made
            # yet, so the refresh making stopped + 2 (tables, then dense parameters) began after training stopped.
            stopped = stub.Lookup(pb.LookupRequest(table="user", ids=b""), timeout=10).state
            deadline = time.monotonic() + 15
            while True:  # the replica refreshes every 0.2 s: wait until every table equals the saved state
                replies = {t: stub.Lookup(pb.LookupRequest(table=t, ids=ids_bytes(asked)), timeout=10) for t in TABLES}
                same = min(r.state for r in replies.values()) >= stopped + 2 and all(
                    torch.equal(torch.frombuffer(bytearray(r.rows), dtype=torch.float32).view(100, r.dim),
                                getattr(local, t)(asked)) for t, r in replies.items())
                if same or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert same, "the replica did not catch up within 15 s"
            caught_up = min(r.state for r in replies.values())

            users, candidates = torch.randint(0, 120, (256,), generator=g), torch.randint(0, 150, (256,), generator=g)
            reply = stub.Predict(pb.PredictRequest(features=[feature("users", users), feature("items", candidates)]),
                                 timeout=10)
            assert reply.state >= caught_up and list(reply.shape) == [256]
            with torch.no_grad():
                want = local(users, candidates)[0]
            assert torch.equal(scores_of(reply), want), "Predict equals local_model of the saved state bit for bit"
            # the same user against candidate items: Score's answers
            items = torch.arange(1, 90)
            score = stub.Score(pb.ScoreRequest(user=7, items=ids_bytes(items)), timeout=10)
            predicted = scores_of(stub.Predict(pb.PredictRequest(features=[
                feature("users", torch.full_like(items, 7)), feature("items", items)]), timeout=10))
            assert torch.allclose(predicted, torch.frombuffer(bytearray(score.scores), dtype=torch.float32),
                                  atol=1e-6, rtol=0)
            # features of any shape go to forward() as they are; the reply has the output's shape
            u2, i2 = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[7, 8, 9], [1, 2, 3]])
            grid = stub.Predict(pb.PredictRequest(features=[feature("users", u2), feature("items", i2)]), timeout=10)
            with torch.no_grad():
                assert torch.equal(scores_of(grid), local(u2, i2)[0])  # MF sums over dim 1: [2, 64]

            bad = {
                "both": pb.Feature(name="users", shape=[1], int64_values=ids_bytes(torch.tensor([1])),
                                   float32_values=b"\0\0\0\0"),
                "neither": pb.Feature(name="users", shape=[1]),
                "shape": feature("users", torch.tensor([1, 2, 3]), shape=[2, 2]),
                "keyword": feature("user_ids", torch.tensor([1, 2])),
            }
            for what, f in bad.items():
                rest = [feature("items", torch.tensor([1, 2]))] + ([feature("users", torch.tensor([1, 2]))]
                                                                   if what == "keyword" else [])
                code, details = code_of(lambda: stub.Predict(pb.PredictRequest(features=[f, *rest]), timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and repr(f.name) in details, (what, code, details)
            code, details = code_of(lambda: stub.Predict(pb.PredictRequest(features=[
                feature("items", torch.tensor([1, 2]))]), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "users" in details, details
            # more than MAX_IDS elements: gRPC's own 4 MiB limit refuses such a message before the handler; the
            # decoding Predict uses refuses it too, naming the feature
            with pytest.raises(PredictError) as many:
                decode_features([feature("users", torch.zeros(MAX_IDS + 1, dtype=torch.int64))], MAX_IDS)
            assert many.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'users'" in str(many.value)

            check_query_stream(stub, metrics, users, candidates)
            with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as page:
                text = page.read().decode()
            assert 'shardps_serving_calls_total{code="NOT_FOUND",method="Lookup"}' in text  # from the stream
            assert 'shardps_serving_calls_total{code="OK",method="Predict"}' in text
            assert 'shardps_serving_calls_total{code="INVALID_ARGUMENT",method="Predict"}' in text
            assert 'shardps_serving_call_seconds_count{method="Predict"}' in text
            # SIGTERM with a stream open: the stream gets the calls' grace (5 s), then ends; the replica exits 0
            feed: queue.Queue = queue.Queue()
            open_stream = stub.Query(iter(lambda: feed.get(timeout=30), None), timeout=60)
            feed.put(pb.ServingQuery(tag=5, score=pb.ScoreRequest(user=7, items=ids_bytes(torch.arange(1, 9)))))
            assert next(open_stream).tag == 5
            signalled = time.monotonic()
            assert serve.stop() == 0
            assert time.monotonic() - signalled < 15, "the replica waited for the open stream past its grace"
            code, _ = code_of(lambda: next(open_stream))
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), code
            feed.put(None)
            serve = None
            channel.close()

            # A replica that never read the dense parameters: UNAVAILABLE (the shards' state, read here).
            replica = Replica(shards.servers, list(TABLES), dense_every=None)
            try:
                state = replica.refresh()
            finally:
                replica.close()
            predictor = Predictor(serving_model())
            with pytest.raises(PredictError) as unavailable:
                predictor.predict(state, {"users": torch.tensor([1]), "items": torch.tensor([1])})
            assert unavailable.value.code == grpc.StatusCode.UNAVAILABLE and "global_bias" in str(unavailable.value)
            # Callers asking at once for one state wait for one build, and all get the same model.
            replica = Replica(shards.servers, list(TABLES), dense_every=0)
            try:
                state = replica.refresh()
            finally:
                replica.close()
            predictor = Predictor(serving_model())  # a predictor serves one replica's states (numbered from 1)
            got, start = [], threading.Barrier(8)

            def ask() -> None:
                start.wait(10)
                got.append(predictor.model_for(state))

            threads = [threading.Thread(target=ask) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(got) == 8 and all(m is got[0] for m in got) and predictor.builds == 1
            assert torch.equal(predictor.predict(state, {"users": users, "items": candidates}), want)
        finally:
            if serve is not None:
                serve.kill()
            dist.close()
