"""Benchmark results files: written under results/ and, on the device tool's machine, copied into its OUT folder."""

from __future__ import annotations

import json

from benchmarks import common


def test_results_are_copied_into_the_output_folder_when_out_is_set(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    path = common.write_results("probe", {"environment": {"gpu": "none"}, "rows": [1]}, "| a |\n|---|")
    assert sorted(p.name for p in out.iterdir()) == sorted([path.name, path.with_suffix(".md").name])
    assert json.loads((out / path.name).read_text())["rows"] == [1]
    assert (out / path.with_suffix(".md").name).read_text() == path.with_suffix(".md").read_text()


def test_results_stay_under_results_without_out(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.delenv("OUT", raising=False)
    path = common.write_results("probe", {"rows": []}, "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert path.exists() and path.with_suffix(".md").exists()


def test_a_tree_run_imports_that_trees_package(tmp_path):
    """ab.py and gemv_rules.py compare packages: the child must import the given tree's pagellm, not this
    checkout's (which `python -c` would put first on sys.path without -P)."""
    (tmp_path / "pagellm").mkdir()
    (tmp_path / "pagellm" / "__init__.py").write_text("WHICH = 'tree'\n")
    source = "import json, sys, pagellm\nprint('noise'); print('RESULT ' + json.dumps([pagellm.WHICH, sys.argv[1:]]))"
    assert common.run_in_tree(tmp_path, source, ["a", "b"]) == ["tree", ["a", "b"]]
