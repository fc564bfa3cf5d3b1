"""Shared benchmark plumbing: timing (median after warm-up) and results files."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

# LDET_RESULTS_DIR puts the results files elsewhere under the same names (gpu_suite.sh: under
# $OUT, the folder a lent device machine sends back)
RESULTS = Path(os.environ.get("LDET_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def step_model(width: int) -> torch.nn.Sequential:
    """The det_ddp step benchmarks' model (ddp_step.py, tools/step_timeline.py, tools/host_ops.py): token
    embedding (vocabulary 512), LayerNorm, MLP (width -> 4 width -> width, GELU), LayerNorm, head
    to 512 classes; plain nn modules, seeded, for det_transform or plain DDP."""
    from torch import nn

    torch.manual_seed(0)
    d = width
    return nn.Sequential(nn.Embedding(512, d), nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                         nn.Linear(4 * d, d), nn.LayerNorm(d), nn.Linear(d, 512))


def det_step_module(width: int):
    """The det_ddp step benchmarks' LightningModule (tools/step_timeline.py, tools/sync_sites.py):
    step_model(width) det_transform'ed, global_mean of the per-token cross-entropy, SGD."""
    import lightning as L
    import torch.nn.functional as F

    from lightning_det import global_mean
    from lightning_det.nn import det_transform

    class DetStepNet(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = step_model(width)
            det_transform(self.net)

        def training_step(self, b, _):
            x, y = b
            return global_mean(F.cross_entropy(self.net(x), y, reduction="none"))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return DetStepNet()


class BatchFetch(torch.utils.data.Dataset):
    """Token/target tensors fetched a batch at a time (``__getitems__``): one index per batch
    instead of a Python collate of every sample; any sampler (det_ddp's included) still picks
    which samples."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, idx):
        i = torch.as_tensor(idx)
        return self.x[i], self.y[i]


def _as_batch(b):
    return b


def token_loader(x: torch.Tensor, y: torch.Tensor, batch: int, shuffle: bool = False):
    """A DataLoader of (tokens, targets) batches fetched with one index each (BatchFetch): the
    default per-sample collate of 4096 tokens took ~60 ms of host time a batch, which a timing
    window over several steps would count."""
    return torch.utils.data.DataLoader(BatchFetch(x, y), batch_size=batch, shuffle=shuffle, collate_fn=_as_batch)


def det_strategy(slices_guess: str = "default"):
    """DeterministicStrategy whose steps plan their GEMMs as the benchmarks' --slices-guess says:
    "default" is the strategy's own "auto" (cached plans on CUDA), "sync" / "cached" force one."""
    from lightning_det.strategy import DeterministicStrategy

    return DeterministicStrategy(gemm_plans={"default": "auto"}.get(slices_guess, slices_guess))


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def device_slug(device: str) -> str:
    """The <device> of a results file's name: "cpu", or the GPU's model as letters then digits
    ("NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB" -> "a100"), else its whole name lowercased
    with "-" between words. The machine's size (GPU count, CPU threads) is inside the file, not in
    its name: the next run on that kind of device overwrites it."""
    if device == "cpu":
        return "cpu"
    if device != "cuda":
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    return gpu_slug(torch.cuda.get_device_name(0))


def gpu_slug(name: str) -> str:
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    model = next((w for w in words if re.fullmatch(r"[a-z]+[0-9]+[a-z]*", w)), None)
    return model or "-".join(w for w in words if w != "nvidia") or "cuda"


def results_path(name: str, device: str) -> Path:
    """benchmarks/results/<device slug>-<name>.json: the one results file of benchmark ``name``
    on this kind of device."""
    return RESULTS / f"{device_slug(device)}-{name}.json"


def commit() -> str:
    if os.environ.get("LDET_COMMIT"):  # the commit sent to a device, whose copied git metadata may be older
        return os.environ["LDET_COMMIT"]
    try:
        here = Path(__file__).parent
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True).strip()
        # tracked files changed since that commit (a device copy of a newer tree, work in progress):
        # say so instead of naming a commit that did not run. Results files do not count: a rerun
        # rewrites its own file before it asks
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                         ":(top,exclude)benchmarks/results"], cwd=here, text=True)
        return sha + ("+modified" if dirty.strip() else "")
    except Exception:  # noqa: BLE001 - a results file without a commit is still useful
        return "unknown"


def call_peak_memory(step, device):
    """(peak_bytes, extra_bytes) of one ``step()`` on CUDA, extra counted from what was allocated
    just before it; (None, None) elsewhere (the CPU has no per-call peak)."""
    if device != "cuda":
        return None, None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak, peak - before


def time_fn(fn, device: str, warmup: int = 2, repeat: int = 5, min_time: float = 0.0) -> float:
    """Median seconds per call after warm-up; CUDA timed with events."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_ratio(base_fn, ours_fn, device: str, rounds: int, warmup: int = 2) -> float:
    """Median over rounds of (base time / ours time), each round timing base then ours back to
    back, so a load that drifts during the run (a shared machine) hits both alike."""
    for _ in range(warmup):
        base_fn()
        ours_fn()
    ratios = []
    for _ in range(rounds):
        t = []
        for fn in (base_fn, ours_fn):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        ratios.append(t[0] / t[1])
    return statistics.median(ratios)


def header(device: str) -> dict:
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def write(name: str, device: str, rows: list, extra: dict | None = None, path: str | Path | None = None) -> Path:
    """Header + rows as JSON at ``path``, default benchmarks/results/<device slug>-<name>.json."""
    out = Path(path) if path else results_path(name, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = header(device)
    if extra:
        doc.update(extra)
    doc["rows"] = rows
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out
