# ruff: noqa
# Flower's own `flwr new` template output, unmodified: flwr 1.24.0 (the last release that
# ships the templates) app/code/task.numpy.py.tpl, rendered with string.Template as `flwr new` does.
"""quickstart-numpy: A Flower / NumPy app."""

import numpy as np


def get_dummy_model():
    return [np.ones((1, 1))]
