"""Writing a tag so that it is complete or never offered for loading: the engine's files, the client state,
the manifest, one commit path (a blocking save is a background save waited for), `latest`, pruning, and
the save directory's lock. Never imports loading/."""
