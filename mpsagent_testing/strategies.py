"""Hypothesis strategies for untrusted documents: any JSON value, and documents that look like config files (so
that checks past the first shape check are reached)."""

from __future__ import annotations

from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5),
    max_leaves=25,
)
# Documents that look like config files, so that the later checks (not only the first shape check) are reached.
_names = st.sampled_from(
    [
        "version",
        "sharing",
        "mps",
        "timeSlicing",
        "resources",
        "name",
        "replicas",
        "rename",
        "devices",
        "flags",
        "plugin",
        "migStrategy",
        "deviceListStrategy",
        "deviceIDStrategy",
        "renameByDefault",
        "gfd",
    ]
)
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-5, 60)
    | st.sampled_from(["v1", "gpu", "nvidia.com/gpu", "all", "mixed", "cdi-cri", "index", "packed", "0", "GPU-x"])
)
config_like = st.recursive(
    _leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_names, children, max_size=4),
    max_leaves=30,
)
