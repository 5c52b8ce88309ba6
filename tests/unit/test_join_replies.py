"""The worker refuses a job whose shards contradict each other, before initialising anything."""

import pytest

from shardps.proto import shardps_pb2 as pb
from shardps.worker.session.join import _check_replies


def reply(version: int, initialise: bool = False, initialised: bool = True, job: str = "j") -> pb.JoinReply:
    return pb.JoinReply(initialise=initialise, version=version,
                        job=pb.JobView(job_id=job, initialiser="w0", initialised=initialised, version=version))


def test_consistent_shards_pass() -> None:
    _check_replies([reply(5), reply(5), reply(6)])  # one round apart: a round applied on one shard first
    _check_replies([reply(0, initialise=True, initialised=False)] * 2)  # a fresh job


@pytest.mark.parametrize("replies, message", [
    ([reply(22), reply(0)], r"versions \[22, 0\]"),
    ([reply(3), reply(0, initialise=True, initialised=False)], r"shard\(s\) \[1\] hold no parameters"),
    ([reply(1, job="a"), reply(1, job="b")], "different jobs"),
])
def test_contradicting_shards_are_refused(replies, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        _check_replies(replies)
