"""Goodput: where a training job's wall time goes, over all its attempts.

Each attempt (a process: a `keras-mgpu launch` attempt's worker, or a
rerun) keeps a time ledger (`keras_mgpu.goodput.ledger`) that charges every
second since it started to one category: startup, compile, productive
training, input wait, checkpoint, restore, evaluation, other.
`DistributedLogger` writes it into each record of `LOG_DIR/metrics.jsonl`;
`read_job(LOG_DIR)` (and `keras-mgpu goodput LOG_DIR`) adds up the
attempts, with the training later attempts redid and the time between
them, into the job's goodput: the share of its wall time spent training
productively.

Standard library only, like `import keras_mgpu`: neither Keras nor
TensorFlow is imported.
"""

from keras_mgpu.goodput.report import AttemptGoodput
from keras_mgpu.goodput.report import GapGoodput
from keras_mgpu.goodput.report import JobGoodput
from keras_mgpu.goodput.report import read_job

__all__ = ["AttemptGoodput", "GapGoodput", "JobGoodput", "read_job"]
