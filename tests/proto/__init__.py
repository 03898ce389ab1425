"""The generated protobuf code (`mpsagent._proto`)."""
