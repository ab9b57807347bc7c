"""Generating responses with a Role's model (greedy.py today; batched KV-cache sampling next)."""
