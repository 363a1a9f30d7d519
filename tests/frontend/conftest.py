"""The front door tests' shared stack: one manager, two CPU workers, a front door in a thread."""

from __future__ import annotations

import pytest
from helpers.frontend import Stack


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.close()
