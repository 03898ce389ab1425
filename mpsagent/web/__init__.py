"""The HTTP endpoint (`/metrics`, `/healthz`, `/readyz`): its routes in `endpoint`, the bounded server in `server`."""

from mpsagent.web.endpoint import WebEndpoint
from mpsagent.web.server import HTTP_LIMITS, HttpLimits

__all__ = ["HTTP_LIMITS", "HttpLimits", "WebEndpoint"]
