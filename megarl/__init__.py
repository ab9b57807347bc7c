"""megarl: Megatron-style 3D-parallel RL post-training (SFT -> reward model -> RL)."""

__version__ = "0.1.0"
