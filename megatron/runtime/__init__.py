"""What every rank process needs around the training step: joining the world, agreeing, stopping, failing.

| module       | job                                                                               |
|--------------|-----------------------------------------------------------------------------------|
| initialize   | distributed backend, megatron-core process groups, seeds, the rank's device      |
| collective   | barriers and agreements outside the step's own collectives                        |
| stop_signals | SIGTERM/SIGINT: stop after the step with a checkpoint; a second signal stops at once |
| rank_errors  | a rank's fixable error as one line and exit status 1, recorded for deepy.py       |
| faults       | the named moments where a test makes a run wait or die                            |
| cpu_info     | py-cpuinfo asked once, early, for DeepSpeed's CPU op builders                      |

Importing this package imports nothing: deepy.py takes the signal and error records from here
without loading torch.
"""
