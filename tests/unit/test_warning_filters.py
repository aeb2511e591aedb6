"""Exactly the two named warnings are silenced; anything else, even a longer message, still shows."""

import warnings

from titanlab import warning_filters


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
