"""tools/issue_bars.py: the bars read off benchmark JSON of the kinds the GPU benches write."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("issue_bars", ROOT / "tools" / "issue_bars.py")
issue_bars = importlib.util.module_from_spec(spec)
spec.loader.exec_module(issue_bars)

RESULTS = ROOT / "docs" / "results"


def by_name(bars):
    return {(b.issue, b.what, b.shape): b for b in bars}


def test_the_h200_runs_of_2026_11_29_read_as_performance_md_says():
    bars, devices = issue_bars.evaluate([
        RESULTS / "2026-11-29-h200-issue17-table-bench.json",
        RESULTS / "2026-11-29-h200-decode-bench.json",
    ])
    assert devices == {"NVIDIA H200"}
    got = by_name(bars)
    d64 = got[(17, "stick-breaking forward TF/s x FA2", "D 64, L 8192")]
    assert abs(d64.measured - 270.5 / 276.4) < 1e-3 and d64.status == "MISSED"
    softmax = got[(17, "softmax f+b TF/s x cuDNN", "D 128, L 32768")]
    assert abs(softmax.measured - 455.7 / 522.3) < 1e-3 and softmax.status == "met"
    decode = got[(17, "softmax decode x copy bandwidth", "32768 keys")]
    assert abs(decode.measured - 3008 / 4225) < 1e-3 and decode.status == "met"
    # Rows no file holds are reported, never taken as met.
    assert got[(10, "entmax-1.5 forward TF/s x AdaSplash-2", "D 128, L 4096")].status == "not measured"
    assert got[(14, "TDA f+b time x FA2's (beta 0)", "D 128, L 4096")].status == "not measured"


def test_a_bar_in_time_holds_below_its_bound(tmp_path):
    rows = []
    for method, ms in (("sdpa_flash", 2.0), ("winnow_tda", 2.9), ("winnow_tda_beta1", 0.5), ("winnow_tra", 1.0)):
        rows.append({"method": method, "L": 4096, "D": 128, "fwd_ms": ms / 4, "fwd_bwd_ms": ms, "fwd_tflops": 100 / ms})
    path = tmp_path / "threshold.json"
    path.write_text(json.dumps({"device": "test", "results": rows, "zero_fractions": {}}))
    got = by_name(issue_bars.evaluate([path])[0])
    assert got[(14, "TDA f+b time x FA2's (beta 0)", "D 128, L 4096")].status == "met"  # 1.45 <= 1.5
    assert abs(got[(14, "TDA forward at beta 1 x beta 0", "D 128, L 4096")].measured - 2.9 / 0.5) < 1e-9
    # The screened row (opt-in) is its own bar; without it in the file, not measured.
    assert got[(14, "TDA fwd, beta 1 screened x beta 0", "D 128, L 4096")].status == "not measured"
    screened = dict(rows[2], method="winnow_tda_beta1_screen", fwd_ms=0.3)
    path.write_text(json.dumps({"device": "test", "results": rows + [screened], "zero_fractions": {}}))
    bar = by_name(issue_bars.evaluate([path])[0])[(14, "TDA fwd, beta 1 screened x beta 0", "D 128, L 4096")]
    assert abs(bar.measured - (2.9 / 4) / 0.3) < 1e-9 and bar.status == "MISSED"  # 2.42 < 3
    # Back to back (fwd_steady_ms) its own bar beside it, read from its own field.
    steady_name = (14, "TDA fwd, b1 screened x b0, steady", "D 128, L 4096")
    assert by_name(issue_bars.evaluate([path])[0])[steady_name].status == "not measured"
    rows[1]["fwd_steady_ms"], screened["fwd_steady_ms"] = 0.6, 0.15
    path.write_text(json.dumps({"device": "test", "results": rows + [screened], "zero_fractions": {}}))
    steady = by_name(issue_bars.evaluate([path])[0])[steady_name]
    assert abs(steady.measured - 4.0) < 1e-9 and steady.status == "met"

    assert got[(14, "TRA forward TF/s x FA2 (beta 0)", "D 128, L 4096")].status == "met"  # 2.0 >= 1.2
    rows[1]["fwd_bwd_ms"] = 3.1
    path.write_text(json.dumps({"device": "test", "results": rows, "zero_fractions": {}}))
    assert by_name(issue_bars.evaluate([path])[0])[(14, "TDA f+b time x FA2's (beta 0)", "D 128, L 4096")].status == "MISSED"
    assert issue_bars.main([str(path), "--strict"]) == 2
    assert issue_bars.main([str(path)]) == 0


def test_unknown_json_is_refused(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"something": 1}))
    assert issue_bars.main([str(path)]) == 1
    assert "not the JSON of a known benchmark" in capsys.readouterr().err


def test_margins_say_how_far_a_bar_is_cleared(capsys):
    # Session 79's run: entmax-1.5's 4K forward 1.504x AdaSplash-2 against a bar of 1.5x.
    bars, _ = issue_bars.evaluate([RESULTS / "2026-11-30-h200-issue10-bars-bench.json"])
    got = by_name(bars)
    forward = got[(10, "entmax-1.5 forward TF/s x AdaSplash-2", "D 128, L 4096")]
    assert forward.status == "met" and 0 < forward.margin < 0.01
    # A bar in time: 1.45 ms against at most 1.5 clears it by 1.5 / 1.45 - 1.
    timed = issue_bars.Bar(14, "t", "s", 1.45, 1.5, at_least=False)
    assert abs(timed.margin - (1.5 / 1.45 - 1)) < 1e-12
    assert issue_bars.Bar(14, "t", "s", None, 1.5, at_least=False).margin is None
    issue_bars.main([str(RESULTS / "2026-11-30-h200-issue10-bars-bench.json")])
    out = capsys.readouterr().out
    assert "+0.3%" in out and "within a run's spread" in out
