"""How a trainer group reports a rank's exception (``_Ranks._collect``): a user's mistake and a failed run stay one
line with their exit codes; anything else names the rank and its log."""

from __future__ import annotations

import pytest

from posttrain.core.actors.trainer_group import _Ranks
from posttrain.core.errors import RunFailed, UsageError


class _Answering(_Ranks):
    """Ranks that answer each call at once with ``replies[rank]``."""

    def __init__(self, replies):
        super().__init__(len(replies), [f"logs/trainer-rank{r}.log" for r in range(len(replies))])
        self.replies = replies

    def _send(self, ranks, message):
        pass

    def _wait(self, pending, timeout_s):
        return {r: self.replies[r] for r in pending}

    def _death(self):
        return None


@pytest.mark.parametrize("name, cls, code", [("RunFailed", RunFailed, 1), ("ConfigError", UsageError, 2)])
def test_a_ranks_one_line_error_keeps_its_kind(name, cls, code):
    ranks = _Answering([("ok", None), ("error", (name, True, "trainer: out of GPU memory in the train pass"))])
    with pytest.raises(cls) as caught:
        ranks.call("train")
    assert caught.value.exit_code == code and str(caught.value) == "trainer: out of GPU memory in the train pass"


def test_any_other_error_names_the_rank_and_its_log():
    ranks = _Answering([("error", ("ValueError", False, "bad shape")), ("ok", None)])
    with pytest.raises(RuntimeError, match=r"trainer rank 0: ValueError: bad shape \(traceback in logs/trainer-rank0"):
        ranks.call("train")


def test_the_watchdog_sees_which_ranks_have_not_answered():
    from posttrain.core.watchdog import WAITS

    seen = []

    class _OneSlow(_Answering):
        """Rank 0 answers at once, rank 1 on the third look."""

        looks = 0

        def _wait(self, pending, timeout_s):
            self.looks += 1
            seen.append([w.what for w in WAITS.active() if w.kind == "trainer_rank"])
            return {0: ("ok", 0)} if 0 in pending else ({1: ("ok", 1)} if self.looks >= 3 else {})

    assert _OneSlow([None, None]).call("train", every=True) == [0, 1]
    assert seen[0] == ["train: ranks [0, 1] of 2 have not answered"]
    assert seen[1] == ["train: ranks [1] of 2 have not answered"]
    assert not [w for w in WAITS.active() if w.kind == "trainer_rank"], "the answer ends the wait"
