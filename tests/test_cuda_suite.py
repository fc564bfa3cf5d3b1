"""benchmarks/cuda_suite.py, the GPU machine's test runner: its list holds every test file with
CUDA tests, and its results lines count what pytest ran."""
import ast
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import cuda_suite  # noqa: E402


def _has_cuda_tests(path: Path) -> bool:
    """Imports the @cuda mark from conftest, or asks torch whether CUDA is there."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module == "conftest" and "cuda" in {a.name for a in node.names}:
            return True
    return "torch.cuda.is_available()" in text


def test_specs_name_every_file_with_cuda_tests():
    found = {p.stem for p in (REPO / "tests").glob("test_*.py") if p.name != Path(__file__).name and _has_cuda_tests(p)}
    listed = [name for name, _ in cuda_suite.SPECS]
    assert len(found) >= 15  # the detection itself finds the files it is meant to
    assert found - set(listed) == set(), "test files with CUDA tests missing from cuda_suite.SPECS"
    assert set(listed) - found == set(), "cuda_suite.SPECS names files without CUDA tests"
    assert len(listed) == len(set(listed))


def test_parse_spec():
    assert cuda_suite.parse_spec("test_crt_route:cuda") == ("test_crt_route", "cuda")
    assert cuda_suite.parse_spec("test_crt_route:!cuda") == ("test_crt_route", "not cuda")
    assert cuda_suite.parse_spec("test_crt_route") == ("test_crt_route", "")
    with pytest.raises(SystemExit, match=r"spec 'test_nope:cuda': expected file:filter with tests/test_nope.py"):
        cuda_suite.parse_spec("test_nope:cuda")


def test_rows_count_what_pytest_ran(tmp_path):
    stamp = {"commit": "c", "device": "d", "torch": "t", "cuda": None}
    with open(tmp_path / "log", "w") as log:
        whole = cuda_suite.run_spec("test_trusted_mode", "", log, stamp)
        one = cuda_suite.run_spec("test_trusted_mode", "other_modes", log, stamp)
        none = cuda_suite.run_spec("test_trusted_mode", "no_such_test", log, stamp)
    n = (REPO / "tests" / "test_trusted_mode.py").read_text().count("\ndef test_")
    assert (whole["passed"], whole["failed"], whole["errors"]) == (n, 0, 0) and n >= 2
    assert (one["file"], one["filter"], one["passed"]) == ("tests/test_trusted_mode.py", "other_modes", 1)
    assert none["errors"] == 1 and none["pytest_exit_status"] == 5  # nothing selected is an error
    cuda_suite.write(tmp_path / "r.json", {"device": "d"}, [whole, one])
    lines = (tmp_path / "r.json").read_text().splitlines()
    assert [json.loads(line.rstrip(",")) for line in lines if line.startswith('    {"file"')] == [whole, one]
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == [whole, one]
