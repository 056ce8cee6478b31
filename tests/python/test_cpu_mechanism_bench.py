"""bench/cpu_mechanism_bench.py at tiny size: every mechanism runs through winnow and the
composed expression, forward and with the backward, and the JSON holds a row for each."""

import json
import os
import subprocess
import sys

import winnow  # noqa: F401  (the package the script must find: its path goes to the script)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "bench", "cpu_mechanism_bench.py")


def run(tmp_path, *extra):
    out = tmp_path / "rows.json"
    # The winnow this test imported (the source tree's, or an installed one under
    # tools/check_pip_install.sh), for the script too.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, SCRIPT, "--lengths", "24", "--heads", "2", "--dim", "16", "--repeats", "1",
                    "--json", str(out), *extra], check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    return json.loads(out.read_text())


def test_every_mechanism_forward_and_backward(tmp_path):
    for extra in ((), ("--backward",)):
        result = run(tmp_path, *extra)
        names = [row["mechanism"] for row in result["rows"]]
        assert names == ["softmax", "stick_breaking", "entmax15", "sparsemax", "entmax13", "sieve_exact", "sieve_bound"]
        assert result["backward"] == bool(extra)
        for row in result["rows"]:
            assert row["winnow_ms"] > 0 and row["composed_ms"] > 0, row
