"""The settings area's one exception class."""

from megatron.errors import ExpectedError


class ConfigError(ExpectedError):
    """A setting is wrong: the message names the file, the key, what is wrong and what to do."""


def where(sources: dict[str, str], name: str) -> str:
    """`file: key` for an error message; a setting no file set is marked as its default."""
    return f"{sources[name]}: {name}" if name in sources else f"{name} (default)"
