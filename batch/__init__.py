"""Offline batch generation with the dart-ray engine on Ray Data.

* :class:`DartGenerator` -- a callable class for ``Dataset.map_batches`` in your own pipelines.
* :func:`run_batch_job` / ``dart-ray batch`` -- a resumable, exactly-once job over parquet/JSONL.

Importing this package does not import Ray (the job imports it when it runs).
"""

from batch.generator import (
    OUTPUT_COLUMNS,
    DartGenerator,
    EngineFailure,
    engine_config_from_dict,
    row_seed,
)
from batch.job import (
    BatchJobConfig,
    DuplicateIdError,
    InputChangedError,
    JobSummary,
    run_batch_job,
)
from batch.store import OutputStore

__all__ = [
    "OUTPUT_COLUMNS",
    "BatchJobConfig",
    "DartGenerator",
    "DuplicateIdError",
    "EngineFailure",
    "InputChangedError",
    "JobSummary",
    "OutputStore",
    "engine_config_from_dict",
    "row_seed",
    "run_batch_job",
]
