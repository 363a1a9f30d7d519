import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _held_blocks_counted_exactly(monkeypatch):
    """After every scheduler update in every worker test, the running set's count of held blocks
    (kept incrementally) equals what the block tables say."""
    from kvpool.worker.running_set import RunningSet

    track = RunningSet.track_usage

    def checked(self) -> None:
        self.check_held()
        track(self)

    monkeypatch.setattr(RunningSet, "track_usage", checked)
