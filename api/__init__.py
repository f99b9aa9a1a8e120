"""pdserve: disaggregated prefill/decode serving for large language models.

The public Python API::

    import pdserve
    llm = pdserve.LLM(model="builtin:tiny")
    out = llm.generate("Hello", pdserve.SamplingParams(max_tokens=8, temperature=0))
"""

from pdserve.core.request import CompletionOutput, RequestOutput
from pdserve.core.sampling_params import SamplingParams
from pdserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
