"""Lightning glue: the det_ddp strategy (Trainer and Fabric), registered with both on import."""
from .det_ddp import DeterministicStrategy

__all__ = ["DeterministicStrategy", "register"]


def register() -> None:
    """Registers det_ddp / det_ddp_spawn with Lightning's Trainer and Fabric registries."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .fabric import FabricDeterministicStrategy

    if "det_ddp" not in StrategyRegistry:
        DeterministicStrategy.register_strategies(StrategyRegistry)
    if "det_ddp" not in STRATEGY_REGISTRY:
        FabricDeterministicStrategy.register_strategies(STRATEGY_REGISTRY)


register()
