"""posttrain: plugin-based RL post-training of LLMs (GRPO, PPO and relatives).

Plugin authors need ``from posttrain import hookimpl`` (see ``posttrain.core.hookspecs``) and the type of
their component's kind from ``posttrain.api``; the component base and the estimator's types are here too.
"""

from posttrain.core.hookspecs import hookimpl, hookspec
from posttrain.core.interfaces import Component, Estimator, EstimatorNeeds
from posttrain.core.schema import option

__version__ = "0.1.0"
__all__ = ["Component", "Estimator", "EstimatorNeeds", "hookimpl", "hookspec", "option", "__version__"]
