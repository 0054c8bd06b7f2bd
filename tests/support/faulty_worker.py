"""``herd worker`` whose device is lost, for tests of what the process does when its engine breaks.

Run as ``python -m support.faulty_worker <herd worker arguments>`` (``tests`` on ``PYTHONPATH``).
Everything is the real worker, except that every forward pass raises and so does the engine's
device check after it: the batch fails and the reset cannot prove the engine sound, as after a
sticky CUDA error. The process must answer its request and exit 1, not linger answering 503.
"""

from __future__ import annotations

import sys
from typing import Any

from herd.cli.main import main
from herd.worker.model_runner import TorchRunner


def _device_lost(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected fault: the device is lost")


TorchRunner.execute = _device_lost  # type: ignore[method-assign]
TorchRunner.check_health = _device_lost  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
