"""A minimal OTLP/HTTP receiver on loopback: it decodes the real protobuf wire format with
opentelemetry-proto, standing in for an OpenTelemetry Collector (none installable here)."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpReceiver:
    def __init__(self) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/metrics":
                    msg, reply = ExportMetricsServiceRequest(), ExportMetricsServiceResponse()
                    target = receiver.metrics
                elif self.path == "/v1/traces":
                    msg, reply = ExportTraceServiceRequest(), ExportTraceServiceResponse()
                    target = receiver.traces
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                msg.ParseFromString(body)
                with receiver._lock:
                    target.append(msg)
                payload = reply.SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gauge_points(self, name: str) -> list:
        """All data points received for one gauge or sum metric, oldest first."""
        with self._lock:
            batches = list(self.metrics)
        points = []
        for req in batches:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            data = m.gauge if m.HasField("gauge") else m.sum
                            points.extend(data.data_points)
        return points

    def histogram_points(self, name: str) -> list:
        """All data points received for one histogram metric, oldest first."""
        with self._lock:
            batches = list(self.metrics)
        return [p for req in batches for rm in req.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name and m.HasField("histogram")
                for p in m.histogram.data_points]

    def metric_names(self) -> set[str]:
        with self._lock:
            return {m.name for req in self.metrics for rm in req.resource_metrics
                    for sm in rm.scope_metrics for m in sm.metrics}

    def spans(self, name: str) -> list:
        with self._lock:
            batches = list(self.traces)
        return [s for req in batches for rs in req.resource_spans for ss in rs.scope_spans
                for s in ss.spans if s.name == name]
