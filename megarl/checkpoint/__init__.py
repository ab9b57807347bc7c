"""Checkpoints: distributed save/load (distributed.py) and Hugging Face interop (hf.py)."""
