"""The kernels' tests test every kernel the build has, whatever the suite's fixed choice."""

import pytest


@pytest.fixture(autouse=True)
def _every_kernel(every_native_kernel):
    yield
