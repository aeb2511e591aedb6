"""A world of one started without torchrun writes its rank identity into os.environ and takes it
away again when it ends, so a later launch from the same process starts clean."""

import os

from titanlab.distributed.init import destroy_distributed, init_distributed

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_a_world_of_one_leaves_no_rank_identity_behind(monkeypatch):
    for key in RANK_ENV:
        monkeypatch.delenv(key, raising=False)
    device, rank, world = init_distributed(30)
    try:
        assert (device.type, rank, world) == ("cpu", 0, 1)
        assert os.environ["RANK"] == "0" and int(os.environ["MASTER_PORT"]) > 0  # the bound port
    finally:
        destroy_distributed()
    assert [k for k in RANK_ENV if k in os.environ] == []


def test_an_identity_from_the_launcher_is_not_touched(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    destroy_distributed()  # no group: nothing to end, and the launcher's identity stays
    assert os.environ["RANK"] == "3" and os.environ["MASTER_PORT"] == "29500"
