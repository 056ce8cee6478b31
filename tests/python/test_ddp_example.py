"""examples/python_ddp/train_ddp.py on the CPU: two processes (gloo) train the GPT with winnow's
attention to the same losses and weights as one process on the same batches.

The two ranks get torchrun's environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
LOCAL_RANK) from the test itself: Debian's torchrun 1.13 fails under Python 3.11 before it
starts any worker (its redirect map is None). With a newer torch, torchrun runs the example as
its docstring shows."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "python_ddp" / "train_ddp.py"
ARGS = ["--device", "cpu", "--steps", "4", "--batch", "8", "--length", "16", "--d-model", "32"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="this torch has no gloo process group")
def test_two_processes_train_like_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = tmp_path / "one.json"
    subprocess.run([sys.executable, str(SCRIPT), *ARGS, "--json", str(one)], env=env, check=True, timeout=300)
    two = tmp_path / "two.json"
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(SCRIPT), *ARGS, "--json", str(two)],
                              env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2",
                                       RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(outputs)
    assert "step 4/4" in outputs[0] and "step" not in outputs[1]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["world"], b["world"]) == (1, 2)
    assert len(b["losses"]) == 4
    for x, y in zip(a["losses"], b["losses"]):
        assert abs(x - y) <= 1e-5 * abs(x)
    assert abs(a["checksum"] - b["checksum"]) <= 1e-5 * max(1.0, abs(a["checksum"]))
