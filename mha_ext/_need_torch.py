"""What the parts of mha_ext that need torch say without it: which torch to
install (the version the parity tests are checked against, from PyTorch's
index of CPU-only wheels: on PyPI that pin is the CUDA build, ~3 GB with its
nvidia packages)."""
from __future__ import annotations

from typing import NoReturn

TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def needs_torch(exc: ModuleNotFoundError, who: str) -> NoReturn:
    """Raise exc again, or, when the module not found is torch itself, a
    ModuleNotFoundError (name "torch") that says what `who` needs and how
    to install it."""
    if exc.name not in (None, "torch"):     # torch's own module missing: torch is broken
        raise exc
    raise ModuleNotFoundError(
        f"{who} needs torch, which is not installed: install the version mha_ext is "
        f"tested against, CPU-only: pip install torch=={TORCH_VERSION} --index-url "
        f"{TORCH_CPU_INDEX} (the same pin from PyPI is the ~3 GB CUDA build)",
        name="torch") from None
