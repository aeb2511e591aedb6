"""Exactly the two named warnings are silenced; anything else, even a longer message, still shows."""

import warnings

from titanlab.observability import warning_filters


def test_only_the_exact_messages_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warning_filters.install()
        for message in warning_filters.MESSAGES:
            warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn(warning_filters.MESSAGES[0] + " (more)", UserWarning, stacklevel=1)
        warnings.warn("DTensor random operators may not have complete support on xpu device mesh",
                      UserWarning, stacklevel=1)  # fmt: skip
        warnings.warn(warning_filters.MESSAGES[1], DeprecationWarning, stacklevel=1)
    shown = [(w.category, str(w.message)) for w in caught]
    assert shown == [
        (UserWarning, warning_filters.MESSAGES[0] + " (more)"),
        (UserWarning, "DTensor random operators may not have complete support on xpu device mesh"),
        (DeprecationWarning, warning_filters.MESSAGES[1]),
    ]


def test_the_messages_are_the_ones_torch_emits():
    """The filtered texts must match what torch and torchdata print today (else a filter that
    matches nothing would pass unnoticed)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_vital("Dataloader", "enabled", "True")  # what StatefulDataLoader calls
    assert [str(w.message) for w in caught] == [warning_filters.MESSAGES[0]]
    import inspect

    from torch.distributed.tensor import _random

    assert "DTensor random operators may not have complete support on" in inspect.getsource(
        _random.is_rng_supported_mesh
    )


def test_torchaos_cuda_kernel_logs_are_dropped_without_cuda_only():
    """`make train` starts without a warning line: importing torchao on a machine without CUDA
    logs nothing once the filters are installed, and the same text with anything added, or a
    machine with CUDA, still shows."""
    import logging
    import subprocess
    import sys

    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stderr);"
        "from titanlab.observability import warning_filters; warning_filters.install(cuda={cuda});"
        "import torchao, torchao.float8, torchao.quantization"
    )
    quiet = subprocess.run([sys.executable, "-c", code.format(cuda=False)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code.format(cuda=True)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "_C_mxfp8" in loud.stderr and "Detected no triton" in loud.stderr

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("torchao.kernel.intmm")
    logger.addHandler(Keep())
    warning_filters.install(cuda=False)
    text = "Warning: Detected no triton, on systems without Triton certain kernels will not work"
    logger.warning(text)
    logger.warning(text + " (and more)")
    assert records == [text + " (and more)"]
