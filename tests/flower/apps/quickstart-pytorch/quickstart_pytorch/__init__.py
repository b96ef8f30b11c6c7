# ruff: noqa
# Flower's own `flwr new` template output, unmodified: flwr 1.24.0 (the last release that
# ships the templates) app/code/__init__.py.tpl, rendered with string.Template as `flwr new` does.
"""quickstart-pytorch: A Flower / PyTorch app."""
