"""The learning rules as pure functions: tensors in, tensors out (see losses.py)."""
