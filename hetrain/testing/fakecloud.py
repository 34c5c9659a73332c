"""A local stand-in for the clouds' instance metadata endpoints (for tests and the demo).

A cloud's metadata service cannot exist on this machine, so this serves the documented
responses of AWS IMDSv2 (token, ``spot/instance-action``), GCP (``instance/preempted``) and
Azure (``scheduledevents``) for any number of emulated nodes, each under ``/<node>``:
``http://127.0.0.1:PORT/<node>`` is the base URL to give that node's watcher. ``preempt``
schedules a notice the way each cloud announces it.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

AWS_TOKEN = "fake-imds-token"


class FakeCloudMetadata:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.notices: dict[str, dict] = {}  # node -> {"aws": {...}, "gcp": True, "azure": [...]}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes | str = b"") -> None:
                body = body.encode() if isinstance(body, str) else body
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _split(self) -> tuple[dict, str]:
                _, node, rest = self.path.split("/", 2) if self.path.count("/") >= 2 else ("", "", "")
                return fake.notices.get(node, {}), "/" + rest

            def do_PUT(self) -> None:
                _, path = self._split()
                if path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(200, AWS_TOKEN)
                self._send(400)

            def do_GET(self) -> None:
                notice, path = self._split()
                for cloud, route in (("aws", "/latest/meta-data/spot/instance-action"),
                                     ("gcp", "/computeMetadata/v1/instance/preempted"),
                                     ("azure", "/metadata/scheduledevents?api-version=2020-07-01")):
                    if path == route and f"raw_{cloud}" in notice:  # an odd answer, as real services give
                        return self._send(200, notice[f"raw_{cloud}"])
                if path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != AWS_TOKEN:
                        return self._send(401)
                    return self._send(200, json.dumps(notice["aws"])) if "aws" in notice else self._send(404)
                if path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403)
                    return self._send(200, "TRUE" if notice.get("gcp") else "FALSE")
                if path == "/metadata/scheduledevents?api-version=2020-07-01":
                    if self.headers.get("Metadata") != "true":
                        return self._send(400)
                    return self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": notice.get("azure", [])}))
                self._send(404)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.host = host
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, node: str) -> str:
        return f"http://{self.host}:{self.port}/{node}"

    def start(self) -> FakeCloudMetadata:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()

    def preempt(self, node: str, seconds_ahead: float, action: str = "terminate") -> datetime:
        """Announce that ``node`` goes away in ``seconds_ahead`` seconds, in every cloud's format."""
        when = (datetime.now(UTC) + timedelta(seconds=seconds_ahead)).replace(microsecond=0)
        self.notices[node] = {
            "aws": {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")},
            "gcp": True,
            "azure": [{"EventId": f"preempt-{node}", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                       "Resources": [node], "EventStatus": "Scheduled",
                       "NotBefore": when.strftime("%a, %d %b %Y %H:%M:%S GMT")}],
        }
        return when

    def answer(self, node: str, cloud: str, body: bytes | str) -> None:
        """Make ``cloud``'s notice endpoint for ``node`` answer ``body`` with status 200, whatever it is."""
        self.notices.setdefault(node, {})[f"raw_{cloud}"] = body

    def clear(self, node: str) -> None:
        self.notices.pop(node, None)
