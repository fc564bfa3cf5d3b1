"""The CUDA tests, file by file, on a GPU machine: one results line per test file.

    python3 benchmarks/cuda_suite.py                                  # every file in SPECS
    python3 benchmarks/cuda_suite.py test_crt_route:cuda "test_crt_route:!cuda"

A spec is file:filter, the filter pytest's -k ("" the whole file; "!cuda" the file's CPU tests,
which then run on the GPU machine's host CPU). Each spec runs in its own pytest process, so a
crash names its file; the output goes to --log, and the counts come from pytest's JUnit XML.

Writes benchmarks/results/<device>-cuda_suite.json (benchmarks/_common.results_path): the run's
device, torch and CUDA versions, commit and date, then one line per spec {file, filter, passed,
failed, errors, skipped, seconds, commit, device, torch, cuda}. Specs named on the command line
replace their own lines and keep the other listed specs' lines (each line says which commit it ran);
a run of every spec (no arguments) rewrites the file. Exit status 1 when any spec failed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

# Every test file with CUDA tests (the @cuda mark of tests/conftest.py, or a "cuda" device
# parameter), and the -k filter that picks them: "cuda" where every CUDA test's id says "cuda",
# else the whole file. tests/test_cuda_suite.py checks that no such file is missing.
SPECS = [
    ("test_adamw_sr", "cuda"),
    ("test_alibi_routes", "cuda"),
    ("test_attention_mask_grad", "cuda"),
    ("test_broadcast_grads", "cuda"),
    ("test_ce_op", "cuda"),
    ("test_combine_rounding", ""),
    ("test_crt_route", "cuda"),
    ("test_cuda_gemm", ""),
    ("test_deferred_checks", ""),
    ("test_det_cross_entropy", "cuda"),
    ("test_det_bmm", "cuda"),
    ("test_det_modules", "cuda"),
    ("test_det_trig", "cuda"),
    ("test_detmath_reference", "cuda"),
    ("test_digest", "cuda"),
    ("test_digit_bounds", ""),
    ("test_digest_callback", "cuda"),
    ("test_eager_rounding", "cuda"),
    ("test_fp64_route", ""),
    ("test_fused_attention", "cuda"),
    ("test_gelu_fast", ""),
    ("test_gemm_plan", "cuda"),
    ("test_gpt_char", "cuda"),
    ("test_indexing", "cuda"),
    ("test_int_slices", "cuda"),
    ("test_keyed_dropout", "cuda"),
    ("test_norm_op", "cuda"),
    ("test_ops_api", ""),
    ("test_reductions", "cuda"),
    ("test_scatter_sum", "cuda"),
    ("test_slices_guess", "cuda"),
]


def parse_spec(spec: str) -> tuple[str, str]:
    name, _, k = spec.partition(":")
    if not (ROOT / "tests" / f"{name}.py").is_file():
        raise SystemExit(f"spec {spec!r}: expected file:filter with tests/{name}.py present")
    return name, "not " + k[1:] if k.startswith("!") else k


def counts(junit: Path) -> dict:
    """passed / failed / errors / skipped from pytest's JUnit XML (one testsuite)."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"]}


def run_spec(name: str, k: str, log, stamp: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{name}.py",
               f"--junitxml={junit}", *(["-k", k] if k else [])]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seconds = round(time.monotonic() - t0, 1)
        log.write(f"$ {' '.join(cmd[1:])}\n{proc.stdout}\n")
        log.flush()
        # exit status 5: nothing selected, which for a listed file means the list is wrong
        if junit.is_file() and proc.returncode in (0, 1):
            row = counts(junit)
        else:
            row = {"passed": 0, "failed": 0, "errors": 1, "skipped": 0, "pytest_exit_status": proc.returncode}
    return {"file": f"tests/{name}.py", "filter": k, **row, "seconds": seconds, **stamp}


def write(path: Path, head: dict, rows: list) -> None:
    """The header indented, then each row on one line, by file. Rows kept from earlier runs keep
    their own commits; the header names one commit only when every row ran at it."""
    rows = sorted(rows, key=lambda r: (r["file"], r["filter"]))
    commits = {r["commit"] for r in rows}
    head = {**head, "commit": commits.pop() if len(commits) == 1 else "each row names the commit it ran at"}
    text = json.dumps({**head, "rows": []}, indent=2)
    lines = ",\n".join("    " + json.dumps(r) for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace('"rows": []', '"rows": [\n' + lines + "\n  ]") + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="*", help="file:filter (default: every file in SPECS)")
    p.add_argument("--log", default=None, help="where pytest's output goes (default: a temporary file)")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/<device>-cuda_suite.json)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cuda_suite.py: no CUDA GPU here; the CUDA tests would all skip")
    from _common import header, results_path

    specs = [parse_spec(s) for s in args.specs] or SPECS
    out = Path(args.out) if args.out else results_path("cuda_suite", "cuda")
    head = header("cuda")
    stamp = {k: head[k] for k in ("commit", "device", "torch", "cuda")}
    kept = []
    if args.specs and out.is_file():
        ran = {(f"tests/{name}.py", k) for name, k in specs}
        listed = {(f"tests/{name}.py", k) for name, k in SPECS}  # a line of a spec since dropped goes
        kept = [r for r in json.loads(out.read_text())["rows"]
                if (r["file"], r["filter"]) not in ran and (r["file"], r["filter"]) in listed]
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="cuda_suite-", suffix=".log")[1])
    rows, ok = [], True
    with open(log_path, "a") as log:
        for name, k in specs:
            row = run_spec(name, k, log, stamp)
            rows.append(row)
            bad = row["failed"] or row["errors"] or not row["passed"]
            ok = ok and not bad
            print(f"{row['file']}{f' [{k}]' if k else ''}: {row['passed']} passed, {row['failed']} failed, "
                  f"{row['errors']} errors, {row['skipped']} skipped ({row['seconds']} s)"
                  + ("  <-- FAILED" if bad else ""), flush=True)
            write(out, head, kept + rows)  # after every file: a run cut short keeps what it finished
    print(f"wrote {out}; pytest output in {log_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
