"""scripts/compare_results.py: the reproduction check of committed eval results."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_results.py"


def _load():
    spec = importlib.util.spec_from_file_location("compare_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _record(item: str, output: str, em: float, budget=64) -> dict:
    return {
        "task": "needle",
        "item_id": item,
        "item_hash": "h" + item,
        "method": "snapkv",
        "budget": budget,
        "status": "ok",
        "output": output,
        "metrics": {"exact_match": em},
    }


def test_identical_rerun_passes_and_any_difference_or_missing_result_fails(tmp_path, capsys):
    compare = _load()
    old = _write(tmp_path / "old", [_record("a", "42", 1.0), _record("b", "7", 0.0), _record("b", "7", 0.0, 128)])
    same = _write(tmp_path / "same", [_record("a", "42", 1.0), _record("b", "7", 0.0, 128)])
    assert compare.main([str(same), str(old)]) == 0
    assert "2 identical, 0 different" in capsys.readouterr().out
    changed = _write(tmp_path / "changed", [_record("a", "41", 1.0), _record("c", "1", 1.0)])
    assert compare.main([str(changed), str(old)]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("differs in output: ('needle', 'a'") for line in out.splitlines())
    assert "missing in" in out and "'c'" in out
    assert "0 identical, 2 different or missing" in out
