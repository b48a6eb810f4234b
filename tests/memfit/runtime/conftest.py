"""The runtime's tests share serve's set-up: the kernels built once per session, one intra-op thread."""

from tests.serve.conftest import _cpu_kernels_built, _single_thread  # noqa: F401 - autouse fixtures
