"""python -m headwise.demo: a tiny run writes the summary and the plot."""

import json

import pytest

from headwise import demo

TINY = ["--steps", "3", "--eval-every", "2", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "16",
        "--batch", "2", "--val-batches", "1", "--corpus-bytes", "200000"]


def test_tiny_run_writes_json_and_png(tmp_path):
    assert demo.main(TINY + ["--out", str(tmp_path), "--variants", "residual", "mhar", "block_attnres", "block_mhar", "dcmha"]) == 0
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["corpus"]["bytes"] == 200000
    assert set(summary["variants"]) == {"residual", "mhar", "block_attnres", "block_mhar", "dcmha"}
    for result in summary["variants"].values():
        assert result["steps"] == 3 and result["tokens_per_s"] > 0
        assert result["best_val_loss"] <= result["final_val_loss"]
        assert [s for s, _ in result["curve"]] == [0, 2, 3]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corpus_is_the_standard_library_source():
    data = demo.load_corpus(100_000)
    assert len(data) == 100_000 and b"def " in bytes(data[:100_000].tolist())


def test_unknown_variant_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        demo.main(["--variants", "hyper", "--out", str(tmp_path)])
