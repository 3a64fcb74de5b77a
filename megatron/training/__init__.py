"""The training loop and what watches it.

| module         | job                                                                          |
|----------------|------------------------------------------------------------------------------|
| loop           | ``pretrain``: set-up (tokenizer, data, model, engine, checkpoint), train, evaluate, save |
| pipe_engine    | the same through DeepSpeed's pipe engine (``pipe_parallel_size > 1``)        |
| learning_rates | GPT-NeoX's schedule as a pure function of the step                           |
| divergence     | a non-finite loss or gradient stops the run before it is saved              |
| diagnostics    | opt-in views: parameter norms, a profiler trace, a memory snapshot            |

The top floor of a rank: it uses checkpointing, objectives, model, data and runtime; none of them
imports it.
"""
