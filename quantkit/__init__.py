"""quantkit: quantize a Hugging Face causal LM, prove what it cost, serve it."""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Load a float model or a quantized checkpoint as a torch model (see `quantkit.runtime.loader.load`)."""
    from quantkit.runtime.loader import load as _load

    return _load(path, **kwargs)
