"""Optional NVIDIA DALI data path over preprocessed shards, batch-for-batch equal to the DataLoader path.

Design: order is ours, not DALI's. The sample order comes from batching.GlobalBatchSampler (the
seeded per-epoch numpy permutation, DP-sharded by rank) that the DataLoader path uses too. DALI's
external_source calls back for sample (iteration, idx_in_batch); the callback maps that to the
sampler's index and reads the sample from the memory-mapped shards (only this rank's samples).
DALI pads each field to seq_len (fn.pad), prefetches prefetch_queue_depth batches ahead (in
Python worker processes when py_workers > 0), and moves them to the GPU when device_id is set.
The last step (labels, loss_mask, position_ids, attention mask) is batching.Collator.finalize,
shared with the DataLoader path, so both paths yield identical batches for the same seed.
We do not use fn.readers.numpy: it expects one file per sample and shuffles with DALI's own RNG,
which cannot reproduce the DataLoader order nor a resume from consumed_samples.
"""
import numpy as np
import torch

from megarl.data.batching import Collator, GlobalBatchSampler, ResumableIterator, make_collator
from megarl.data.errors import DataError
from megarl.data.preprocess import load_preprocessed
from megarl.utils.processes import signals_blocked


def import_dali():
    """Import nvidia.dali lazily, with an install hint instead of an ImportError traceback."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        raise DataError("the DALI data path needs NVIDIA DALI: pip install megarl[dali] "
                        "(or pip install nvidia-dali-cuda130)") from None
    return fn, pipeline_def, types


class ShardSource:
    """external_source callback: SampleInfo -> this rank's sample, as a tuple of 1-D arrays.

    Picklable without the memory maps (reopened lazily), so DALI worker processes can run it.
    """

    def __init__(self, data_dir: str, packing: bool, keys: tuple[str, ...], sampler: GlobalBatchSampler):
        self.data_dir, self.packing, self.keys, self.sampler = data_dir, packing, keys, sampler
        self._dataset = None

    def __getstate__(self):
        return {**self.__dict__, "_dataset": None}

    def __call__(self, info):
        if self._dataset is None:
            self._dataset = load_preprocessed(self.data_dir, self.packing)
        index = self.sampler.micro_batch(info.iteration)[info.idx_in_batch]
        item = self._dataset[index]
        return tuple(np.ascontiguousarray(item[k]) for k in self.keys)


def _to_torch(tensor_list, device_id):
    """A dense DALI TensorList [b, s] -> torch tensor on GPU device_id (or CPU when None)."""
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    dense = tensor_list.as_tensor()
    device = "cpu" if device_id is None else f"cuda:{device_id}"
    out = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device=device)
    stream = None if device_id is None else torch.cuda.current_stream(device_id)
    return feed_ndarray(dense, out, cuda_stream=stream)


class DaliDataIterator(ResumableIterator):
    """Endless micro-batches for one DP rank from preprocessed shards through a DALI pipeline.

    Same constructor arguments, batches, consumed_samples and state_dict as batching.DataIterator.
    device_id=None runs the pipeline on CPU (tests); an int puts batches on that GPU.
    py_workers > 0 (not used by the trainers, which read in DALI's threads) starts DALI's Python
    workers with spawn (fork is unsafe once CUDA is up), which re-imports the main script: call
    it under `if __name__ == "__main__":` then.
    """

    def __init__(self, data_dir: str, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True, consumed_samples: int = 0,
                 packing: bool = False, device_id: int | None = None, num_threads: int = 2,
                 prefetch_queue_depth: int = 2, py_workers: int = 0):
        import_dali()
        self.data_dir, self.packing, self.device_id = data_dir, packing, device_id
        self.dataset = load_preprocessed(data_dir, packing)
        self.collator: Collator = make_collator(self.dataset)
        self.keys = tuple(self.dataset[0].keys())
        self.args = dict(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                         dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle)
        self.pipe_args = dict(num_threads=num_threads, prefetch_queue_depth=prefetch_queue_depth,
                              py_workers=py_workers)
        self.pipe = None
        self._start(consumed_samples)

    def _start(self, consumed_samples: int) -> None:
        self._sampler(len(self.dataset), consumed_samples)
        self.close()
        self.pipe = self._build_pipeline()

    def _build_pipeline(self):
        fn, pipeline_def, types = import_dali()
        sample = self.dataset[0]
        dali_type = {np.dtype(np.int32): types.INT32, np.dtype(np.uint8): types.UINT8}
        source = ShardSource(self.data_dir, self.packing, self.keys, self.sampler)
        workers = self.pipe_args["py_workers"]

        @pipeline_def(batch_size=self.args["micro_batch_size"], num_threads=self.pipe_args["num_threads"],
                      device_id=self.device_id, prefetch_queue_depth=self.pipe_args["prefetch_queue_depth"],
                      py_num_workers=max(1, workers), py_start_method="spawn")
        def pipeline():
            fields = fn.external_source(source=source, num_outputs=len(self.keys), batch=False,
                                        parallel=workers > 0, dtype=[dali_type[sample[k].dtype] for k in self.keys])
            outs = []
            for key, field in zip(self.keys, fields):
                field = fn.pad(field, axes=(0,), shape=(self.dataset.seq_len,),
                               fill_value=self.collator.fill_value(key))            # [b, s]
                outs.append(field.gpu() if self.device_id is not None else field)
            return tuple(outs)

        pipe = pipeline()
        with signals_blocked():  # py_workers > 0: DALI's worker processes start here
            pipe.build()
        return pipe

    def __next__(self) -> dict:
        outputs = self.pipe.run()
        padded = {k: _to_torch(o, self.device_id) for k, o in zip(self.keys, outputs)}
        self._advance()
        return self.collator.finalize(padded)

    def close(self) -> None:
        """Release the pipeline (and its worker processes)."""
        if self.pipe is not None:
            del self.pipe
            self.pipe = None
