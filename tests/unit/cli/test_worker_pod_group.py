"""``herd worker``'s pod group: flags first, else LeaderWorkerSet's env vars, else one pod."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd.cli.main import build_parser
from herd.cli.worker import pod_group
from herd.worker.config import EngineConfig, PodGroup

LWS = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2", "LWS_LEADER_ADDRESS": "m-0.m.ns"}


def group(flags: list[str], environ: dict[str, str]) -> PodGroup:
    argv = ["worker", "--model", "m", *flags]
    args = build_parser(argv).parse_args(argv)
    return pod_group(args, environ)


@pytest.mark.parametrize(
    ("flags", "environ", "expected"),
    [
        ([], {}, PodGroup()),
        ([], LWS, PodGroup(size=4, index=2, leader_host="m-0.m.ns")),
        (
            [
                "--group-size",
                "2",
                "--group-index",
                "1",
                "--leader-address",
                "127.0.0.5",
                "--rendezvous-port",
                "7000",
            ],
            LWS,
            PodGroup(size=2, index=1, leader_host="127.0.0.5", port=7000),
        ),
        (["--join-timeout", "5"], {}, PodGroup(join_timeout_s=5)),
    ],
    ids=["one-pod", "from-lws-env", "flags-win", "join-timeout"],
)
def test_the_group_comes_from_flags_then_lws_env(
    flags: list[str], environ: dict[str, str], expected: PodGroup
) -> None:
    assert group(flags, environ) == expected


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        (["--group-size", "2", "--group-index", "2"], {}, "pod index 2 is outside a group of 2 pods"),
        ([], {"LWS_GROUP_SIZE": "two"}, "LWS_GROUP_SIZE"),
        (["--group-size", "0"], {}, "--group-size"),
        (["--join-timeout", "0"], {}, "--join-timeout"),
    ],
    ids=["index-outside", "bad-env", "no-pods", "no-timeout"],
)
def test_a_bad_group_is_refused_naming_its_source(
    flags: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        group(flags, environ)


def test_the_ranks_split_evenly_over_the_pods(tiny_llama: Path) -> None:
    spread = EngineConfig(
        model_path=tiny_llama, served_name="m", engine={"tensorParallelSize": 4}, group=PodGroup(size=2)
    )
    assert spread.ranks_per_pod == 2
    with pytest.raises(ValueError, match="tensorParallelSize 3 does not split evenly over 2 pods"):
        EngineConfig(
            model_path=tiny_llama, served_name="m", engine={"tensorParallelSize": 3}, group=PodGroup(size=2)
        )
