"""The HTTP endpoint (`mpsagent.web`): the bounded server, its routes, and `/metrics` through a real agent."""
