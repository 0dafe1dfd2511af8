"""Operators: nn.Modules that replace Hugging Face modules (one concern per file). Importing the
package registers every operator and op under the names rule files use."""
from . import attention, experts, gate, layer, layernorm, linear, moe, rope  # noqa: F401  (they register)
from .base import BaseInjectedModule, set_phase
from .context import RunContext

__all__ = ["BaseInjectedModule", "RunContext", "set_phase"]
