"""The documents (`mpsagent.documents`): the status document and the `--once` report, pinned by the golden files
beside them (`golden/`)."""
