"""lightning-det: bitwise-deterministic training arithmetic for PyTorch and Lightning.

Layers (dependencies point downward only):
  lightning_det.ops      exact long-accumulator ops over the compiled core (no Lightning import)
  lightning_det.nn       DetLinear and friends, det_transform (no Lightning import)
  lightning_det.optim    AdamWSR (no Lightning import)
  strategy / callbacks / cli   Lightning glue
"""
from .profile import PROFILE

__version__ = "0.1.0"
__all__ = ["PROFILE", "__version__"]
