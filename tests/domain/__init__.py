"""The domain (`mpsagent.domain`): plain data in, decisions out, no sockets."""
