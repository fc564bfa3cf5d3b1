"""Fabric(strategy="det_ddp") training for the tests: prints the weights' SHA-256 after each step."""
import hashlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import lightning as L  # noqa: E402

import lightning_det  # noqa: E402,F401
from lightning_det import global_mean  # noqa: E402
from lightning_det.data import DeterministicSampler  # noqa: E402
from lightning_det.nn import det_transform  # noqa: E402


def main(devices: int, accum: int, clip: float) -> None:
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="det_ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = det_transform(nn.Sequential(nn.Embedding(30, 8), nn.Flatten(), nn.LayerNorm(24), nn.Linear(24, 16),
                                        nn.GELU(), nn.Linear(16, 5)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 30, (96, 3), generator=g)
    y = x.sum(1) % 5
    per_rank = 16 // (devices * accum)
    sampler = DeterministicSampler(len(x), per_rank, num_replicas=devices, rank=fabric.global_rank, seed=0)
    idx = list(sampler)
    for step in range(4):
        for a in range(accum):
            start = (step * accum + a) * per_rank
            b = torch.tensor(idx[start : start + per_rank])
            loss = global_mean(F.cross_entropy(model(x[b]), y[b], reduction="none")) / accum
            with fabric.no_backward_sync(model, enabled=a < accum - 1):  # Fabric's accumulation idiom
                fabric.backward(loss)
        if clip:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        if fabric.global_rank == 0:
            print(f"step {step + 1} {h}", flush=True)


if __name__ == "__main__":
    from lightning_det.parallel.env import run_then_destroy_process_group

    run_then_destroy_process_group(main, int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
