"""With $WINNOW_EXPECT_INSTALLED (tools/check_pip_install.sh), the tests run against the
package that `pip install` put into that environment: fail at once if `winnow` or its
operator library come from anywhere else (the source tree, build/). With
$WINNOW_EXPECT_EDITABLE (`pip install -e .`), the package must come from the source tree and its
library from that environment."""

import os
from pathlib import Path

import pytest

# The shared samples module sits beside the tests.
import sys
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    installed = os.environ.get("WINNOW_EXPECT_INSTALLED")
    editable = os.environ.get("WINNOW_EXPECT_EDITABLE")
    if not installed and not editable:
        return
    import winnow
    package = Path(winnow.__file__).resolve().parent
    library = winnow.library_path.resolve()
    source = Path(__file__).resolve().parents[2] / "python"
    expected = ([("the package", package, Path(installed).resolve()),
                 ("its library", library, Path(installed).resolve())] if installed else
                [("the package", package, source),
                 ("its library", library, Path(editable).resolve())])
    for what, path, prefix in expected:
        if prefix not in path.parents:
            raise pytest.UsageError(f"winnow: {what} was loaded from {path}, not from "
                                    f"{prefix}")
