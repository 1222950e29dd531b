"""The group's collectives the open and the served group use, on a group of one process."""

from __future__ import annotations

from turbospark_core.distributed import world


def test_a_group_of_one_agrees_with_itself_and_broadcasts_what_it_sends() -> None:
    group = world()
    assert (group.rank, group.size) == (0, 1)
    assert group.agree(True) and not group.agree(False)
    assert group.broadcast_bytes(b"\x00\xffcall") == b"\x00\xffcall"
    assert group.broadcast_json({"op": "add", "prompt": [1, 2], "x": None}) == {
        "op": "add",
        "prompt": [1, 2],
        "x": None,
    }
    seed = group.shared_seed()
    assert isinstance(seed, int) and 0 <= seed < 2**31
    assert world() is group
