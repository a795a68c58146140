"""``torch.distributed.checkpoint`` storage that compresses every rank's shards with s4weights.

* :mod:`s4w_core.dcp.writer` -- :class:`S4StorageWriter` (one checkpoint folder, or step ``N`` of a
  run's root) and its pinned staging;
* :mod:`s4w_core.dcp.reader` -- :class:`S4StorageReader` (resharding loads: each rank decodes only
  the storages its plan needs);
* :mod:`s4w_core.dcp.meta` -- what both share: where a checkpoint's bytes live (a folder or a run
  step), DCP's metadata as JSON, item keys;
* :mod:`s4w_core.dcp.run` -- a run's layout: one :class:`~s4w_core.store.CheckpointStore` per rank,
  a step committed by its metadata record, written last.

Example::

    import torch.distributed.checkpoint as dcp
    from s4w_core.dcp import S4StorageWriter, S4StorageReader

    dcp.save(state, storage_writer=S4StorageWriter("ckpt/step_100"))           # one checkpoint
    dcp.async_save(state, storage_writer=S4StorageWriter("s3://bucket/run", step=300))  # a run's step
    dcp.load(state, storage_reader=S4StorageReader("s3://bucket/run"))          # its newest step
"""

from s4w_core.dcp.meta import METADATA_NAME
from s4w_core.dcp.reader import S4StorageReader
from s4w_core.dcp.run import close_rank_stores, committed_steps, wait_rank_stores
from s4w_core.dcp.writer import S4StorageWriter

__all__ = ["S4StorageWriter", "S4StorageReader", "METADATA_NAME", "committed_steps", "close_rank_stores", "wait_rank_stores"]
