"""Times the exact LayerNorm kernels alone at the GPT-2-small step's shape (8192 x 768, bf16)
against F.layer_norm, for inputs of several scales: whether a launch is slow by itself."""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_det.ops.norm import norm_backward, norm_forward  # noqa: E402


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.ones(768, device=dev) + 0.01 * torch.randn(768, device=dev, generator=g)
    b = 0.01 * torch.randn(768, device=dev, generator=g)
    for R in (8192,):
        for scale in (1.0, 0.02):
            for dt in (torch.bfloat16, torch.float32):
                x = (scale * torch.randn(R, 768, device=dev, generator=g)).to(dt)
                gy = (1e-3 * torch.randn(R, 768, device=dev, generator=g)).to(dt)
                y, xh, rs = norm_forward(x, w, b, 1e-5, False)
                f = timed(lambda: norm_forward(x, w, b, 1e-5, False))
                bw = timed(lambda: norm_backward(gy, xh, rs, w, False, dt))
                ref = timed(lambda: F.layer_norm(x, (768,), w.to(dt), b.to(dt), 1e-5))
                print(f"R {R} scale {scale} {str(dt):15s} det fwd {f:.3f} ms  det bwd {bw:.3f} ms  "
                      f"F.layer_norm fwd {ref:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
