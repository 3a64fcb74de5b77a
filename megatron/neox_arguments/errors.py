"""The settings area's one exception class."""


class ConfigError(Exception):
    """A setting is wrong: the message names the file, the key, what is wrong and what to do."""


def where(sources: dict[str, str], name: str) -> str:
    """`file: key` for an error message; settings nobody set are marked as defaults."""
    return f"{sources.get(name, 'default')}: {name}"
