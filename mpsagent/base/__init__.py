"""Foundations every layer uses: the settings table (`settings`), the config file's schema (`config`), value types
(`devices`), cgroups, bounded host file access (`host`), untrusted YAML/JSON within bounds (`untrusted`), logging
(`logs`) and the exception tree (`errors`)."""
