"""Built-in tasks whose answers run in the sandbox: ``countdown`` and ``code``."""
