"""The quantization pipeline: load, calibrate block by block, pack, save (quantize.py);
KV-cache scales for an existing model (kv.py); YAML recipes that drive both (recipe.py)."""
