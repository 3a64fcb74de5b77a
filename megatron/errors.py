"""The base of every error the user can fix by changing a setting, a file or the machine.

Each area keeps its own class (ConfigError, DataError, CheckpointError, ...); all of them derive
from ExpectedError, so a rank reports any of them as one line instead of a traceback. Anything
else is a bug and keeps its traceback. A leaf module: it imports nothing from the project.
"""


class ExpectedError(Exception):
    """The message says what is wrong, where (file or setting) and what to do."""
