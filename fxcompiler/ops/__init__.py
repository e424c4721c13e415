"""fxcompiler's torch.library ops (namespace ``fxc``); importing registers them."""
from .paged_attention import paged_attention, paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference"]
