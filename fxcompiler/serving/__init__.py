"""Serving entry points: the engine API (``LLMEngine``, ``AsyncLLMEngine``) and the OpenAI-compatible server.

This subpackage is a composition root: it may import ``runtime/`` (through ``LLM``), the core may not import it.
"""
from .engine import AsyncLLMEngine, EngineDeadError, LLMEngine, TokensPrompt

__all__ = ["AsyncLLMEngine", "EngineDeadError", "LLMEngine", "TokensPrompt"]
