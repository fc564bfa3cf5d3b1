"""``lightning-det report RUN [RUN ...] -o report.png``: loss curves, divergence, chain table."""
from __future__ import annotations

import json
import struct
import sys

from ..digest.compare import diff_runs, load_run


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="plot loss curves of runs, mark the first divergence, tabulate chain digests",
        description="Plot the loss of every step of one or more runs (rank 0) on one figure, mark where each "
                    "run first diverges from the first run, and show the chain digests of each run at its last "
                    "step in a small table. Needs matplotlib (pip install 'lightning-det[plot]') unless only "
                    "--json is asked for.")
    p.add_argument("runs", nargs="+", help="DigestCallback dirpaths; the first is the reference")
    p.add_argument("-o", "--output", help="image file to write (png, pdf, svg)")
    p.add_argument("--rank", type=int, default=0, help="rank whose losses are plotted (default 0)")
    p.add_argument("--run", type=int, metavar="N", help="when a folder's files hold several runs, take the Nth")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _loss_value(rec: dict) -> float | None:
    loss = rec.get("loss")
    if not loss:
        return None
    if loss.get("dtype") == "float32" and loss.get("hex"):
        return struct.unpack("<f", bytes.fromhex(loss["hex"]))[0]  # exactly the recorded bits
    return loss.get("value")


def summarize(paths: list[str], rank: int = 0, run_index: int | None = None) -> dict:
    runs = [load_run(p, run_index) for p in paths]
    rows = []
    for i, run in enumerate(runs):
        steps = run.steps.get(rank, {})
        last = max(steps) if steps else None
        row = {"run": str(run.path), "label": run.label, "notes": run.notes, "steps": len(steps), "last_step": last,
               "chain": steps[last]["chain"] if last is not None else None,
               "loss": [[s, _loss_value(steps[s])] for s in sorted(steps)]}
        if i > 0:
            d = diff_runs(runs[0], run, [rank])
            row["diverges_at"] = None if d["identical"] else d.get("step")
        rows.append(row)
    return {"rank": rank, "runs": rows}


def plot(summary: dict, output: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("lightning-det report needs matplotlib to draw: pip install 'lightning-det[plot]' "
                           "(or use --json for the numbers only)") from exc
    rows = summary["runs"]
    fig, (ax, tab) = plt.subplots(2, 1, figsize=(9, 6.5), gridspec_kw={"height_ratios": [3, 1]})
    for i, row in enumerate(rows):
        xs = [s for s, v in row["loss"] if v is not None]
        ys = [v for s, v in row["loss"] if v is not None]
        ax.plot(xs, ys, label=f"[{i}] {row['run']}", linewidth=1.4, linestyle="-" if i == 0 else "--")
        if row.get("diverges_at"):
            ax.axvline(row["diverges_at"], color=ax.lines[-1].get_color(), alpha=0.6, linestyle=":")
            ax.annotate(f"[{i}] diverges at step {row['diverges_at']}", (row["diverges_at"], ax.get_ylim()[1]),
                        rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"loss (rank {summary['rank']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    tab.axis("off")
    cells = [[f"[{i}]", r["label"], str(r["last_step"]), (r["chain"] or "-")[:16],
              "reference" if i == 0 else ("identical" if r.get("diverges_at") is None else f"step {r['diverges_at']}")]
             for i, r in enumerate(rows)]
    t = tab.table(cellText=cells, colLabels=["run", "label", "last step", "chain digest", "first divergence"], loc="center")
    t.auto_set_font_size(False)
    t.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def run(args) -> int:
    if not args.output and not args.json:
        print("lightning-det report: error: give -o OUTPUT and/or --json", file=sys.stderr)
        return 2
    summary = summarize(args.runs, args.rank, args.run)
    if args.output:
        try:
            plot(summary, args.output)
        except RuntimeError as exc:
            print(f"lightning-det report: error: {exc}", file=sys.stderr)
            return 2
        summary["output"] = args.output
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for i, r in enumerate(summary["runs"]):
            status = "reference" if i == 0 else ("identical" if r.get("diverges_at") is None else
                                                 f"diverges at step {r['diverges_at']}")
            print(f"[{i}] {r['run']} ({r['label']}): {r['steps']} steps, chain {(r['chain'] or '-')[:16]}  {status}")
            for note in r["notes"]:
                print(f"    note: {note}")
        print(f"wrote {args.output}")
    return 0
