"""python -m headwise.bench: the harness runs every benchmark end to end at tiny shapes
(--quick) and writes its table, JSON, PNG and profiler trace. Measures nothing."""

import json

import pytest

from headwise.bench.__main__ import BENCHMARKS, main


def test_quick_run_of_every_benchmark_writes_json_png_and_trace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, out_png, trace = tmp_path / "b.json", tmp_path / "b.png", tmp_path / "trace.json"
    assert main(["--quick", "--profile", "--device", "cpu", "--json", str(out_json), "--png", str(out_png),
                 "--trace", str(trace)]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["op"] for r in rows} >= {"mhar_route", "decoder", "qkv_project", "head_merge", "dcmha_attention"}
    assert {r["impl"] for r in rows} >= {"eager", "compile", "headwise"}
    assert all(r["ms"] > 0 for r in rows)
    assert "vs compile" in table
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert "headwise::mhar_route" in trace.read_text()
    assert set(BENCHMARKS) >= {"mhar", "qkv", "merge", "dcmha", "model"}
