"""examples/python_gpt/train_gpt.py at tiny size on the CPU: the GPT with winnow.nn attention
trains with the fused operators and with the composed expressions from the same start on the
same batches, and the two loss curves agree (float32); the example's own arguments are checked.
The H100 run (torch.compile, L = 1024) is in docs/performance.md."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "python_gpt" / "train_gpt.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mechanism", ["stick_breaking", "softmax", "entmax", "sieve"])
def test_kernel_and_composed_training_agree(example, mechanism, tmp_path):
    result = example.main(["--device", "cpu", "--no-compile", "--compare", "--mechanism", mechanism,
                           "--length", "24", "--batch", "3", "--steps", "6", "--d-model", "32",
                           "--heads", "2", "--lr", "3e-3", "--timing-warmup", "1",
                           "--json", str(tmp_path / "gpt.json")])
    kernel, composed = result["runs"]
    assert kernel["parameters"] == composed["parameters"]
    assert all(torch.isfinite(torch.tensor(kernel["losses"])))
    assert kernel["losses"][-1] < kernel["losses"][0]  # it trains
    assert result["max_relative_loss_difference"] < 1e-4, result
    assert (tmp_path / "gpt.json").is_file()


def test_copy_batches_hold_the_copy(example):
    tokens, targets = example.copy_batch(torch.Generator().manual_seed(0), 2, 10, 7, "cpu")
    assert tokens.shape == targets.shape == (2, 10)
    assert torch.equal(tokens[:, 5:], tokens[:, :5])
    counted = targets != -100
    assert counted.sum(1).tolist() == [5, 5]  # positions 4 .. 8 predict the copy
    assert torch.equal(targets[:, 4:9], tokens[:, 5:10])


def test_bad_length_is_an_error_naming_it(example):
    with pytest.raises(SystemExit):
        example.parse(["--length", "7"])


def test_profile_prints_the_operators_of_the_steps(example, capsys):
    example.main(["--device", "cpu", "--no-compile", "--length", "16", "--batch", "2",
                  "--steps", "2", "--d-model", "32", "--heads", "2", "--timing-warmup", "1",
                  "--profile", "1"])
    printed = capsys.readouterr().out
    # The table itself: which operators make its top rows depends on the host's timing.
    assert "profile of 1 steps (kernel):" in printed
    assert "Self CPU time total" in printed
