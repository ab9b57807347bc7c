"""A dense reward for RL tests from random initialisation: the fraction of a response's
characters that are digits (a random byte-level policy writes one about every 26 tokens)."""


def digits(prompts, responses, answers):
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]
