"""Data layer: JSONL formats, tokenizers and chat loss masks, the synthetic task, batching, preprocess/DALI.

Typical use by a trainer:
    tok = load_tokenizer("byte")                       # or load_tokenizer("hf", "path/to/tokenizer")
    ds = build_sft_dataset("train.jsonl", tok, seq_len=128, policy="fail", packing=False)
    it = DataIterator(ds, micro_batch_size, global_batch_size, dp_rank, dp_size, seed=seed,
                      consumed_samples=resumed)        # next(it) -> fixed-shape micro-batch dict
DALI (optional, nvidia.dali imported lazily) lives in megarl.data.dali.
"""
from megarl.data.answers import extract_answer, is_correct
from megarl.data.batching import Collator, DataIterator, GlobalBatchSampler, collate_prompts, epoch_permutation
from megarl.data.chat import ChatTemplateError
from megarl.data.datasets import (PreferenceDataset, PromptDataset, SFTDataset, build_preference_dataset,
                                  build_prompt_dataset, build_sft_dataset)
from megarl.data.errors import DataError, Report
from megarl.data.preprocess import load_preprocessed, preprocess
from megarl.data.synthetic import write_synthetic_dataset
from megarl.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer", "ChatTemplateError", "Collator", "DataError", "DataIterator", "GlobalBatchSampler",
    "HFTokenizer", "PreferenceDataset", "PromptDataset", "Report", "SFTDataset", "build_preference_dataset",
    "build_prompt_dataset", "build_sft_dataset", "collate_prompts", "epoch_permutation", "extract_answer",
    "is_correct", "load_preprocessed", "load_tokenizer", "preprocess", "write_synthetic_dataset",
]
