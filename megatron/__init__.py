"""Our package shares the name ``megatron`` with the megatron-core distribution.

Extending ``__path__`` keeps ``megatron.core`` (installed by megatron-core) importable next to
our own subpackages.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
