"""The foundations (`mpsagent.base`): the config and the settings, host files, cgroups, errors, logs, backoff."""
