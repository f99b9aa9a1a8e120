"""pdserve: disaggregated prefill/decode serving for large language models.

The public Python API::

    import pdserve
    llm = pdserve.LLM(model="builtin:tiny")
    out = llm.generate("Hello", pdserve.SamplingParams(max_tokens=8, temperature=0))

``LLM`` is imported on first use (it brings torch): a command that only checks
its flags, or a module of the package that needs no engine, starts without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.core.request import CompletionOutput, RequestOutput
from pdserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
