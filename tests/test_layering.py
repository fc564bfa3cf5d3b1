"""The layers import downward only: ops, nn and optim never load Lightning, and det_ddp is still
registered with Lightning's Trainer and Fabric however the imports are ordered.

Each case runs in a fresh interpreter with a clean environment, since this process has long
imported Lightning.
"""
import sys

import pytest

from conftest import run_cmd

_LOADED = "import sys; print(sorted(m for m in ('lightning', 'lightning.pytorch', 'lightning.fabric') if m in sys.modules))"


def _loaded_after(code: str) -> str:
    return run_cmd([sys.executable, "-c", f"{code}\n{_LOADED}"], timeout=120).stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["lightning_det.ops", "lightning_det.nn", "lightning_det.optim", "lightning_det"])
def test_lower_layers_do_not_import_lightning(module):
    assert _loaded_after(f"import {module}") == "[]", f"import {module} loaded Lightning"


def test_lightning_glue_does_import_lightning():
    # control: the check above sees an import of Lightning where there is one
    assert _loaded_after("import lightning_det.strategy") == "['lightning', 'lightning.fabric', 'lightning.pytorch']"


_RESOLVE = """
import lightning
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning_det._lightning_hook import _Finder, _Loader
from lightning_det.strategy import DeterministicStrategy
from lightning_det.strategy.fabric import FabricDeterministicStrategy
trainer = Trainer(strategy="det_ddp", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
fabric = Fabric(strategy="det_ddp", accelerator="cpu", devices=1)
spawn = Trainer(strategy="det_ddp_spawn", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
print(type(trainer.strategy) is DeterministicStrategy, type(fabric.strategy) is FabricDeterministicStrategy,
      type(spawn.strategy) is DeterministicStrategy and spawn.strategy._start_method == "spawn",
      any(isinstance(f, _Finder) for f in sys.meta_path), isinstance(lightning.__spec__.loader, _Loader),
      isinstance(lightning.__loader__, _Loader))
"""


@pytest.mark.parametrize("first", ["import lightning_det", "import lightning", "from lightning.fabric import Fabric"])
def test_det_ddp_resolves_for_trainer_and_fabric(first):
    # Lightning imported after lightning_det (the import hook registers) or before it (registered at once).
    code = f"import sys\n{first}\nimport lightning_det\n{_RESOLVE}"
    out = run_cmd([sys.executable, "-c", code], timeout=180).stdout.strip().splitlines()[-1]
    # the hook leaves no trace: the finder is gone and the module shows Python's own loader
    assert out == "True True True False False False", out


def test_without_lightning_det_det_ddp_is_unknown():
    # control: the strategy names resolve only because lightning_det registered them
    code = ("import lightning\nfrom lightning.pytorch import Trainer\n"
            "try:\n    Trainer(strategy='det_ddp', accelerator='cpu', devices=1)\n"
            "except ValueError as e:\n    print('unknown', 'det_ddp' in str(e))\n")
    out = run_cmd([sys.executable, "-c", code], timeout=120).stdout.strip().splitlines()[-1]
    assert out == "unknown True", out
