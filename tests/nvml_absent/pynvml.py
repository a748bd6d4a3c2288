"""`pynvml` for subprocess tests (first on PYTHONPATH): NVML without a driver, as on a machine without a GPU."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvml_fake import FakeNVML  # noqa: E402 - after the path that finds it

_FAKE = FakeNVML(init_error="NVML Shared Library Not Found")


def __getattr__(name):
    return getattr(_FAKE, name)
