"""Optimizers by name (``OPTIMIZER.NAME``): torch's ``adamw`` and ``sgd`` built in, your own registered.

Register your own from your training script::

    from linnaeus_accel import register_optimizer

    @register_optimizer("lion")
    def build_lion(param_groups, config):     # config: the whole Config
        return Lion(param_groups, lr=0.0, weight_decay=config.OPTIMIZER.WEIGHT_DECAY,
                    **config.OPTIMIZER.OPTIONS)

and set ``OPTIMIZER.NAME: lion``. ``param_groups`` are dicts with ``params``, ``name`` (the
LR_SCHEDULER group's label), ``lr_group`` (its index: the LR schedule sets the group's ``lr`` every
step, so build with ``lr=0.0``) and, where the config decides it, ``weight_decay`` (see
``linnaeus_accel.training.start.setup.parameter_groups``). Keep the groups' keys: torch's optimizers do.
"""

from .registry import OPTIMIZERS, OptimizerBuilder, build_from_config, register_optimizer

__all__ = ["OPTIMIZERS", "OptimizerBuilder", "build_from_config", "register_optimizer"]
