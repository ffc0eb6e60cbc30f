"""quantkit: quantize a Hugging Face causal LM, prove what it cost, serve it.

    from quantkit import LLM, SamplingParams, load, quantize, evaluate

    quantize("smollm2-135m", "out/awq", "awq")                 # a checkpoint folder
    evaluate("out/awq", baseline="smollm2-135m", limit=8)     # perplexity, side by side
    llm = LLM("out/awq")                                      # the engine
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    model = load("out/awq")                                   # a torch module, as transformers gives

Names are imported on first use, so `import quantkit` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantkit.version import __version__

if TYPE_CHECKING:
    from quantkit.api import evaluate, quantize
    from quantkit.runtime.engine import LLM
    from quantkit.runtime.loader import load
    from quantkit.runtime.sequence import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__", "evaluate", "load", "quantize"]

_WHERE = {
    "LLM": "quantkit.runtime.engine",
    "SamplingParams": "quantkit.runtime.sequence",
    "load": "quantkit.runtime.loader",
    "quantize": "quantkit.api",
    "evaluate": "quantkit.api",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
