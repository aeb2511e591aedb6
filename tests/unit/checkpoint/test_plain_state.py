"""The data-loader state is stored as JSON in a uint8 tensor, and nothing in titanlab unpickles."""

import ast
import os

import pytest
import torch

from titanlab.checkpoint import plain_state

PACKAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    "titanlab",
)
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "shelve",
    "marshal",
    "joblib",
}


def test_round_trip_of_a_loader_state():
    state = {
        "_num_yielded": 7,
        "_sampler_iter_state": {"sampler_state": {"epoch": 1, "seed": 3}},
        "_shared_seed": None,
        "_iterator_finished": False,
        "name": "ü",
    }
    t = plain_state.encode(state)
    assert t.dtype == torch.uint8 and t.dim() == 1
    assert plain_state.decode(t) == state


@pytest.mark.parametrize(
    "bad", [{"t": (1, 2)}, {1: "int key"}, {"b": b"bytes"}, {"o": object()}, {"nan": float("nan")}]
)
def test_encode_refuses_what_json_would_change(bad):
    with pytest.raises(ValueError):
        plain_state.encode(bad)


@pytest.mark.parametrize("raw", [b"\x80\x04\x95", b"[1, 2]", b"{not json", b"\xff\xfe"])
def test_decode_refuses_anything_but_a_json_object(raw):
    with pytest.raises(ValueError):
        plain_state.decode(torch.tensor(list(raw), dtype=torch.uint8))
    with pytest.raises(ValueError):
        plain_state.decode(torch.zeros(2, 2, dtype=torch.uint8))


def _python_files():
    for folder, _, files in os.walk(PACKAGE):
        yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_no_pickle_in_titanlab():
    """No module of titanlab imports a pickle-like module or calls torch.load without
    weights_only=True (a checkpoint handed to a user must not run code through our code)."""
    offenders = []
    for path in _python_files():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if set(names) & UNSAFE_MODULES:
                offenders.append(f"{path}:{node.lineno} imports {names}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if kw.get("weights_only") != "True":
                    offenders.append(f"{path}:{node.lineno} torch.load without weights_only=True")
    assert not offenders, offenders
    assert sum(1 for _ in _python_files()) > 30  # the walk really saw the package
