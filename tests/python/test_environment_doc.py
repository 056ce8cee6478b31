"""docs/environment.md names every WINNOW_* variable the sources read, and no other."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where variables are read: the library, the operators, the model layer, the tool, the Python
# package and its tests (the GPU scripts and benches only set them for the library).
READERS = ["src", "apps", "include", "python", "tests"]
NAME = re.compile(r"\bWINNOW_[A-Z0-9_]+\b")
# Reads: getenv("X") / os.environ.get("X") / os.environ["X"] directly, or a helper given the
# name as a string literal (forced_by("X"), forced_scalar("X"), env_int("X", ...),
# blocks_or_env("X", ...)).
READ = re.compile(r"""(?:getenv|environ\.get|environ\[|forced_by|forced_scalar|env_int|blocks_or_env)\(?\s*["'](WINNOW_[A-Z0-9_]+)["']""")


def names_read():
    found = set()
    for folder in READERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".cpp", ".cu", ".cuh", ".h", ".py"} or path == Path(__file__):
                continue
            found.update(READ.findall(path.read_text(errors="replace")))
    return found


def names_documented():
    text = (ROOT / "docs" / "environment.md").read_text()
    return {m.group(1) for m in re.finditer(r"^\| `(WINNOW_[A-Z0-9_]+)` \|", text, re.M)}


def test_every_variable_read_is_documented_and_no_other():
    read, documented = names_read(), names_documented()
    assert read, "found no variable reads: the pattern no longer matches the sources"
    assert read - documented == set(), "read but not in docs/environment.md"
    assert documented - read == set(), "in docs/environment.md but read nowhere"
