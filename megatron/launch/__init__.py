"""deepy.py's side of a run: the command that starts the ranks and the watch over them until they end.

| module      | job                                                                                 |
|-------------|-------------------------------------------------------------------------------------|
| launcher    | DeepSpeed's launcher command for the settings (pure; testable without a run)        |
| entry       | ``python -m megatron.launch.entry``: DeepSpeed's per-node launcher, signals blocked |
| supervision | the launcher in its own process group, signals passed on, nothing left behind       |

Imports run down only: launch uses the settings (neox_arguments) and the runtime's signal and error
records; nothing in the ranks' runtime or the training loop imports launch.
"""
