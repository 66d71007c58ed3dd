"""posttrain: plugin-based RL post-training of LLMs (GRPO, PPO and relatives).

Plugin authors need only ``from posttrain import hookimpl``; see ``posttrain.core.hookspecs``.
"""

from posttrain.core.hookspecs import hookimpl, hookspec
from posttrain.core.schema import option

__version__ = "0.1.0"
__all__ = ["hookimpl", "hookspec", "option", "__version__"]
