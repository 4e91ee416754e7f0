"""`_inside_fit`, for `DistributedLogger`'s check for a hand-written loop.

`BackupAndRestore` lives in `keras_mgpu.callbacks.backup` and no longer
walks frames; this module goes once the logger stops importing it.
"""


def _inside_fit(frame, model) -> bool:
    """Whether `frame` (where a signal interrupted the main thread) runs
    inside `model.fit`."""
    while frame is not None:
        if (frame.f_code.co_name == "fit"
                and frame.f_locals.get("self") is model):
            return True
        frame = frame.f_back
    return False
