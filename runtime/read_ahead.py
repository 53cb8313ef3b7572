"""Read ahead: a background thread computes the next tensors while the caller writes the current one."""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch


def iter_tensors(reader, names: list[str], depth: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, reader.get(name)) in order while a background thread computes the next `depth`.

    Reading, the ops and writing all release the GIL, so on two cores the next tensor is read and
    merged while the current one is written. Memory: at most depth + 1 output tensors alive."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for name in names:
                if stop.is_set():
                    return
                q.put((name, reader.get(name), None))
        except BaseException as e:  # re-raised in the consumer, with its traceback
            q.put((None, None, e))

    thread = threading.Thread(target=work, name="bam-surgery-read-ahead", daemon=True)
    thread.start()
    try:
        for _ in names:
            name, tensor, err = q.get()
            if err is not None:
                raise err
            yield name, tensor
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)
