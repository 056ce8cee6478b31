"""With $WINNOW_EXPECT_INSTALLED (tools/check_pip_install.sh), the tests run against the
package that `pip install` put into that environment: fail at once if `winnow` or its
operator library come from anywhere else (the source tree, build/)."""

import os
from pathlib import Path

import pytest

# The shared samples module sits beside the tests.
import sys
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    prefix = os.environ.get("WINNOW_EXPECT_INSTALLED")
    if not prefix:
        return
    import winnow
    prefix = Path(prefix).resolve()
    package = Path(winnow.__file__).resolve().parent
    for what, path in (("the package", package), ("its library", winnow.library_path.resolve())):
        if prefix not in path.parents:
            raise pytest.UsageError(f"winnow: {what} was loaded from {path}, not from the "
                                    f"installed environment {prefix}")
