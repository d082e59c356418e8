"""python -m headwise.prune --quick: every stage runs and writes the summary and the plot;
a second run reuses the saved base model and measures the same scores, losses and gates."""

import json

import pytest

from headwise import prune


def test_quick_run_writes_json_and_png_and_reuses_the_checkpoint(tmp_path):
    assert prune.main(["--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "prune.json").read_text())
    assert not summary["base"]["reused"] and (tmp_path / "base.pt").exists()
    lines = summary["masks"]["lines"]
    assert set(lines) == {"AHON (LN)", "circuit (LN)", "AHON", "circuit", "random"}
    for points in lines.values():
        assert [p["quantile"] for p in points] == list(prune.FRACTIONS)
        assert points[0]["removed"] == 0.0 and points[-1]["removed"] == 0.75  # 8 heads: ceil(0.75 * 7) = 6
        assert len({p["val_loss"] for p in points}) > 1
    gates = summary["gates"]
    assert 0.0 <= gates["sparsity"] <= 1.0 and gates["heads"] == 8 and len(gates["expected_open_heads"]) == 3
    pruning = summary["pruning"]
    if "refused" not in pruning:
        assert pruning["logits_rel_diff"] <= 2e-5
        assert set(pruning["step_ms"]) == {"unmasked", "masked", "pruned"}
        assert len(pruning["asked_masks"]) == len(pruning["pruned_masks"]) == 2
    second = tmp_path / "again"
    second.mkdir()
    (second / "base.pt").write_bytes((tmp_path / "base.pt").read_bytes())
    assert prune.main(["--quick", "--out", str(second)]) == 0
    again = json.loads((second / "prune.json").read_text())
    assert again["base"]["reused"] and again["base"]["val_loss"] == summary["base"]["val_loss"]
    # every stage seeds its own batches: reusing the checkpoint measures the same things
    assert again["masks"] == summary["masks"]
    assert again["gates"]["pi"] == summary["gates"]["pi"] and again["gates"]["curve"] == summary["gates"]["curve"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "prune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_errors(tmp_path):
    with pytest.raises(SystemExit):
        prune.main(["--steps", "0", "--out", str(tmp_path)])
