"""fxcompiler's torch.library ops (namespace ``fxc``); importing registers them."""
from . import linear  # noqa: F401  (fxc::linear, fxc::linear_w8)
from . import collectives  # noqa: F401  (fxc::all_reduce, fxc::all_gather)
from . import quant_linear  # noqa: F401  (fxc::linear_w4, fxc::linear_f8)
from . import w8a8_linear  # noqa: F401  (fxc::linear_w8a8)
from . import w4a8_linear  # noqa: F401  (fxc::linear_w4a8)
from . import f8_linear  # noqa: F401  (fxc::linear_f8f8)
from . import quant_embedding  # noqa: F401  (fxc::embedding_w8, fxc::embedding_w4)
from .moe import moe, moe_reference
from .fused import rms_norm, rms_norm_reference, rope, rope_reference, silu_mul, silu_mul_reference
from .paged_attention import (paged_attention, paged_attention_reference, qkv_paged_attention,
                              qkv_paged_attention_reference)
from .sampling import (apply_token_bitmask, apply_token_bitmask_reference, greedy_logprob,
                       greedy_logprob_reference)

__all__ = ["apply_token_bitmask", "apply_token_bitmask_reference", "greedy_logprob", "greedy_logprob_reference", "moe", "moe_reference", "paged_attention", "paged_attention_reference",
           "qkv_paged_attention", "qkv_paged_attention_reference", "rms_norm", "rms_norm_reference", "rope", "rope_reference", "silu_mul",
           "silu_mul_reference"]
