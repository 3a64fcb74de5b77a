"""deepy.py's side of a run: the command that starts the ranks and the watch over them until they end.

| module      | job                                                                                   |
|-------------|---------------------------------------------------------------------------------------|
| launcher    | this machine's rank commands, or DeepSpeed's runner command (pure; testable unrun)    |
| supervision | the ranks in their own process group, signals passed on, nothing left behind          |

Imports run down only: launch uses the settings (neox_arguments) and the runtime's signal and error
records; nothing in the ranks' runtime or the training loop imports launch.
"""
