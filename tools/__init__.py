"""Project tools that are not part of the federated runtime (run from the repo root:
`python -m tools.<name>`)."""
