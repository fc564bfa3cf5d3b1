"""``lightning-det diff RUN_A RUN_B``: the first step (and module) where two runs part."""
from __future__ import annotations

import json

from ..digest.compare import diff_runs, load_run


def add_parser(sub) -> None:
    p = sub.add_parser(
        "diff", help="compare two runs' digests; exit 0 if identical, 1 if they diverge",
        description="Compare the DigestCallback files of two runs step by step. Prints 'identical through "
                    "step N' or the first differing step with the tensors that differ, in model order. When "
                    "both runs were captured (DigestCallback(capture_steps=...)), also names the earliest "
                    "module whose output differs and whether its inputs were equal.")
    p.add_argument("run_a", help="DigestCallback dirpath (or a digests-rank*.jsonl file)")
    p.add_argument("run_b", help="the run to compare against RUN_A")
    p.add_argument("--rank", type=int, action="append", help="compare only this rank (repeatable; default all)")
    p.add_argument("--max-tensors", type=int, default=20, help="list at most this many tensors per section")
    p.add_argument("--run-a", dest="run_a_index", type=int, metavar="N", help="when RUN_A's files hold several runs, compare the Nth")
    p.add_argument("--run-b", dest="run_b_index", type=int, metavar="N", help="when RUN_B's files hold several runs, compare the Nth")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def _fmt_loss(d: dict) -> str:
    return f"{d['a']!r} (0x{d['a_hex']}) vs {d['b']!r} (0x{d['b_hex']})"


def format_result(res: dict, max_tensors: int = 20) -> str:
    if res.get("error"):
        return f"cannot compare: {res['error']}"
    labels = f"run labels: a {res['labels']['a']}, b {res['labels']['b']}"
    notes = [f"note: {n}" for n in res.get("notes", [])]
    if res["identical"]:
        lines = [f"identical through step {res['through_step']} ({res['common_steps']} steps compared, "
                 f"rank(s) {', '.join(map(str, res['ranks']))})", labels, *notes]
        if res.get("unmatched_steps"):
            lines.append(f"note: steps present in only one run: {res['unmatched_steps']}")
        return "\n".join(lines)
    lines = [f"diverged at step {res['step']} (rank {res['rank']}); identical through step {res['through_step']}",
             labels, *notes]
    by_sec: dict = {}
    for d in res["differences"]:
        by_sec.setdefault(d["section"], []).append(d)
    for sec, ds in by_sec.items():
        if sec == "loss":
            lines.append(f"  loss: {_fmt_loss(ds[0])}")
            continue
        names = [d["tensor"] for d in ds]
        more = f" ... (+{len(names) - max_tensors} more)" if len(names) > max_tensors else ""
        lines.append(f"  {sec} ({len(names)}): {', '.join(names[:max_tensors])}{more}")
    loc = res.get("localization")
    if loc:
        if loc["status"] == "found":
            where = f"step {loc['step']}, micro-batch {loc['micro']}, event {loc['seq']}"
            lines.append(f"first differing module: {loc['module']} ({loc['type']}) {loc['phase']} [{where}]")
            if loc["verdict"] == "op":
                what = "inputs and parameters" if loc["phase"] == "forward" else "incoming gradients"
                lines.append(f"  its {what} were equal: the op itself differs")
            else:
                which = [] if loc["inputs_equal"] else ["inputs"]
                if not loc["params_equal"]:
                    which.append("parameters")
                lines.append(f"  its {' and '.join(which)} already differed: the difference entered before this "
                             "module (outside the captured modules or before the capture window)")
        elif loc["status"] == "no_difference":
            lines.append(f"capture: all {loc['events']} captured module events are equal; the difference arises "
                         "outside module forward/backward (loss reduction, gradient communication, optimizer)")
        else:
            lines.append(f"capture: {loc.get('message', loc['status'])}")
    else:
        lines.append("(capture both runs with DigestCallback(capture_steps=(k, k)) to find the module)")
    return "\n".join(lines)


def run(args) -> int:
    res = diff_runs(load_run(args.run_a, args.run_a_index), load_run(args.run_b, args.run_b_index), args.rank)
    print(json.dumps(res, indent=2) if args.json else format_result(res, args.max_tensors))
    if res.get("error"):
        return 2
    return 0 if res["identical"] else 1
