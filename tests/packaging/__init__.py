"""The packaging (packaging/: the one-file executable, the images, the manifests and the Helm chart, the dashboard and
the alerts), and the docs and the architecture held to the code."""
