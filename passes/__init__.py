"""Built-in graph passes; importing this package registers each by name."""
from . import cleanup, fusion, weight_layout  # noqa: F401

__all__ = ["cleanup", "fusion", "weight_layout"]
from . import lower_cpu_kernels  # noqa: E402,F401
from . import constants, logits_slice  # noqa: E402,F401
from . import auto_bfloat16_cast  # noqa: E402,F401
from . import decompose  # noqa: E402,F401
from . import cse  # noqa: E402,F401
from . import canonicalize_indices  # noqa: E402,F401
__all__ += ["decompose", "cse", "canonicalize_indices"]
from . import mppp  # noqa: E402,F401
from . import quantize  # noqa: E402,F401
