"""jaild's version: one literal, imported by every module that names it (the client's
``Hello``, the daemon's ``Welcome`` and metrics, tracing's resource, the MCP server's
``initialize``); ``jaild.__version__`` is this, lazily. A module here imports it from
here, never from ``jaild`` itself (tests/unit/test_layering.py, rule "package")."""

__version__ = "0.1.0"
