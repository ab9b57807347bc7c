"""megarl: Megatron-style 3D-parallel RL post-training (SFT -> reward model -> RL)."""

__version__ = "0.1.0"


def __getattr__(name):  # the Python API, imported on first use (torch and megatron are heavy)
    if name == "Pipeline":
        from megarl.trainers.pipeline import Pipeline

        return Pipeline
    if name == "load_config":
        from megarl.config import load_config

        return load_config
    if name == "load_pipeline_config":
        from megarl.trainers.pipeline import load_pipeline_config

        return load_pipeline_config
    raise AttributeError(f"module 'megarl' has no attribute {name!r}")


__all__ = ["Pipeline", "load_config", "load_pipeline_config", "__version__"]
