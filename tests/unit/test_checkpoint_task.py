"""CheckpointTask: one dump or load at a time, its progress for Status."""

from __future__ import annotations

import pytest

from embedding_store.checkpoint_task import CheckpointTask
from embedding_store.errors import UnavailableError


def test_a_second_task_is_refused_naming_the_running_one_until_the_first_ends() -> None:
    task = CheckpointTask("parameter server")
    assert task.state() == ("", 0.0)
    task.begin("dumping")
    assert task.state() == ("dumping", 0.0)
    with pytest.raises(UnavailableError) as refused:
        task.begin("loading")
    assert str(refused.value.message) == (
        "the parameter server is busy dumping a checkpoint; retry when it is done"
    )
    assert task.state() == ("dumping", 0.0)  # the refused call changed nothing
    task.end()
    assert task.state() == ("", 0.0)
    task.begin("loading")
    assert task.state() == ("loading", 0.0)
    task.end()


@pytest.mark.parametrize(
    ("done", "total", "fraction"),
    [(0, 4, 0.0), (1, 4, 0.25), (4, 4, 1.0), (5, 4, 1.0), (0, 0, 1.0)],
)
def test_progress_is_done_over_total_capped_to_one(done: int, total: int, fraction: float) -> None:
    task = CheckpointTask("embedding worker")
    task.begin("loading")
    task.set_progress(done, total)
    assert task.state() == ("loading", fraction)
    task.end()
