"""lightning-det: bitwise-deterministic training arithmetic for PyTorch and Lightning.

Layers (dependencies point downward only):
  lightning_det.ops       exact long-accumulator ops over the compiled core (no Lightning import)
  lightning_det.nn        DetLinear and friends, det_transform (no Lightning import)
  lightning_det.optim     AdamWSR, exact clipping (no Lightning import)
  lightning_det.parallel  gradient sync, global_mean, exact reduce, audit (no Lightning import)
  strategy / callbacks / cli   Lightning glue

``import lightning_det`` registers ``Trainer(strategy="det_ddp")`` (and ``"det_ddp_spawn"``,
and ``Fabric(strategy="det_ddp")``) without importing Lightning: at once if Lightning is already
imported, else when it is (:mod:`lightning_det._lightning_hook`).
"""
from ._lightning_hook import register_when_imported
from .parallel.loss import global_mean, global_sum
from .profile import PROFILE

__version__ = "0.1.0"
__all__ = ["PROFILE", "global_mean", "global_sum", "__version__"]

register_when_imported()
