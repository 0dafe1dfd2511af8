"""Operators: nn.Modules that replace Hugging Face modules (one concern per file)."""
from .base import BaseInjectedModule, set_phase

__all__ = ["BaseInjectedModule", "set_phase"]
