"""det_ddp with an out-of-range cross-entropy target in its third batch (tests/test_deferred_checks.py).

    python tests/helpers/bad_target_run.py --accelerator cpu --out result.json

Batches 1-2 are valid; training_step puts one target equal to the class count into batch 3. Writes the error (type
and message), the optimizer steps completed and whether the weights at the error equal those
after step 2 (the deferred check must raise before step 3 changes anything).
"""
import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F

import lightning_det  # noqa: F401  (strategy="det_ddp")
from lightning_det import global_mean
from lightning_det.nn import det_transform


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 5))
        det_transform(self.net)
        self.after = {}

    def training_step(self, batch, _):
        x, y = batch
        if self.trainer.global_step == 2:  # the third batch: one target outside [0, 5)
            y = y.clone()
            y[3] = 5
        # reduction 'none' + global_mean: the path whose target check is deferred (a 'mean'
        # reduction needs the valid-row count on the host, so it checks at once)
        return global_mean(F.cross_entropy(self.net(x), y, reduction="none"))

    def on_train_batch_end(self, *a):
        self.after[self.trainer.global_step] = [p.detach().clone().cpu() for p in self.parameters()]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 16, (24,), generator=g)
    y = x % 5
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = Net()
    trainer = L.Trainer(accelerator=a.accelerator, devices=1, strategy="det_ddp", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    err = None
    try:
        trainer.fit(model, dl)
    except Exception as e:  # noqa: BLE001 - the point of the run
        err = f"{type(e).__name__}: {e}"
    now = [p.detach().cpu() for p in model.parameters()]
    step2 = model.after.get(2)
    result = {"error": err, "steps": trainer.global_step,
              "weights_as_after_step_2": step2 is not None and all(torch.equal(u, v) for u, v in zip(now, step2)),
              "step_2_changed_weights": step2 is not None and not all(
                  torch.equal(u, v) for u, v in zip(step2, model.after.get(1, step2)))}
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
