"""What is on disk and whether it can be trusted: every file name (layout.py), manifests and the once-per-node
checks against them, weights-only unpickling, what a model-states file stores besides weights (client state,
RNG states, forward-validation logits), reading a tag's module weights, and the inventory of a directory:
which tag a request reads (CheckpointInventory.chosen_tag) and at what layout it was saved
(TagInventory.saved_layout). Reads files, never an engine or the run's settings; imports only formats/."""
