"""Input pipelines that keep every replica fed: sharded TFRecords in, batches out.

One module per job: `writer` (`write_tfrecords`), `spec` (`spec.json`),
`reader` (`tfrecord_dataset`, `verify_tfrecords`), `batching` (`rebatch`,
`batch_size_of`) and `structure` (the element structure the writer encodes
and the reader decodes).
"""

from keras_mgpu.data.batching import UnknownLengthWarning  # noqa: F401
from keras_mgpu.data.batching import batch_size_of  # noqa: F401
from keras_mgpu.data.batching import rebatch  # noqa: F401
from keras_mgpu.data.reader import tfrecord_dataset  # noqa: F401
from keras_mgpu.data.reader import verify_tfrecords  # noqa: F401
from keras_mgpu.data.spec import SPEC_FILE  # noqa: F401
from keras_mgpu.data.spec import SPEC_VERSION  # noqa: F401
from keras_mgpu.data.spec import read_spec  # noqa: F401
from keras_mgpu.data.writer import write_tfrecords  # noqa: F401

__all__ = [
    "tfrecord_dataset", "write_tfrecords", "verify_tfrecords", "read_spec",
    "rebatch", "batch_size_of", "UnknownLengthWarning", "SPEC_FILE",
    "SPEC_VERSION",
]
